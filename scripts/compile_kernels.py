#!/usr/bin/env python
"""Compiles the Triton attention kernels for a GPU architecture, on any machine (no GPU needed):
every variant the engine would launch for a list of model shapes, with the launchers' own tiles
and warps, down to a cubin. Prints, per variant, the compile time, registers, stack (non-zero:
registers spilled) and shared memory, and exits non-zero if any variant fails to compile (or,
with --strict, spills).

What it proves: the installed triton compiles the kernels for that architecture. Not that they
run correctly or fast there (that needs the GPU: the `gpu` tests and scripts/gpu_check.sh).

    .venv/bin/python scripts/compile_kernels.py [--arch 90] [--quick] [--strict]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("unset TRITON_INTERPRET: the interpreter compiles nothing")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from engine.runner.kernels import triton_attention as ta  # noqa: E402

SHAPES = [  # name, dtype, KV pool dtype, query heads per KV head, head dim, sliding window, soft-cap
    ("llama-3-8b", torch.bfloat16, torch.bfloat16, 4, 128, 0, 0.0),
    ("llama-3-8b, fp8 pool", torch.bfloat16, torch.float8_e4m3fn, 4, 128, 0, 0.0),
    ("qwen2-7b (groups of 7)", torch.bfloat16, torch.bfloat16, 7, 128, 0, 0.0),
    ("phi-3 (head dim 96)", torch.bfloat16, torch.bfloat16, 1, 96, 0, 0.0),
    ("gemma-2 (head dim 256, window, soft-cap)", torch.bfloat16, torch.bfloat16, 2, 256, 4096, 50.0),
    ("llama 1B, fp32", torch.float32, torch.float32, 4, 64, 0, 0.0),
]
TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8e4nv"}
BLOCK_SIZE = 16


def signature(kernel, dtype, kv_dtype, constants) -> dict:
    """Triton type of every argument of a kernel, by the launchers' naming."""
    pointers = {"Q": dtype, "OUT": dtype, "K": kv_dtype, "V": kv_dtype, "PART_O": torch.float32,
                "PART_LSE": torch.float32}
    sig = {}
    for name in kernel.arg_names:
        if name in constants:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = "*" + TYPES[pointers[name]]
        elif name in ("TABLES", "ROWS", "CTX", "SPANS"):
            sig[name] = "*i32"
        elif name in ("scale", "softcap"):
            sig[name] = "fp32"
        else:  # strides, window, num_splits, H
            sig[name] = "i32"
    return sig


def usage(cubin: bytes) -> dict:
    """REG, STACK and SHARED of the cubin's kernel, from cuobjdump (shipped with triton)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    return {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED):(\d+)", text.split("Function", 1)[-1])}


def variants(quick: bool):
    """(label, kernel, dtype, kv dtype, constants, warps) the launchers would use."""
    for name, dtype, kv, groups, d, window, cap in SHAPES[:1] if quick else SHAPES:
        for split in (False, True):
            c = ta.decode_constants(dtype, groups, d, BLOCK_SIZE, split, window, cap)
            yield f"decode{' split' if split else ''}  {name}", ta._decode_kernel, dtype, kv, c, ta.decode_warps(d)
        c = dict(D=d, BLOCK_S=ta.MAX_SPLITS, BLOCK_D=ta._block_d(d))
        yield f"merge  {name}", ta._merge_kernel, dtype, kv, c, 4
        c = ta.chunk_constants(dtype, groups, d, BLOCK_SIZE, window, cap)
        yield f"chunk  {name}", ta._chunk_kernel, dtype, kv, c, ta.chunk_warps(d)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    ap.add_argument("--quick", action="store_true", help="the first shape only")
    ap.add_argument("--strict", action="store_true", help="fail on register spills too")
    args = ap.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    print(f"triton {triton.__version__}, sm_{args.arch}")
    failed = spilled = 0
    for label, kernel, dtype, kv, constants, warps in variants(args.quick):
        start = time.perf_counter()
        try:
            src = ASTSource(kernel, signature(kernel, dtype, kv, constants), constexprs=constants)
            compiled = triton.compile(src, target=target, options={"num_warps": warps,
                                                                   "num_stages": ta.STAGES})
        except Exception as exc:  # noqa: BLE001  report every variant, then fail
            failed += 1
            print(f"FAIL  {label}: {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}")
            continue
        res = usage(compiled.asm["cubin"])
        spilled += res.get("STACK", 0) > 0
        print(f"ok    {label:<58} {time.perf_counter() - start:5.1f}s  regs {res.get('REG', '?'):>3}  "
              f"stack {res.get('STACK', '?'):>3}  shared {compiled.metadata.shared:>6}  warps {warps}")
    print(f"{failed} failed, {spilled} with spills")
    return 1 if failed or (spilled and args.strict) else 0


if __name__ == "__main__":
    sys.exit(main())
