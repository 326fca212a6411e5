#!/usr/bin/env python
"""Quantized weights against float32 on CPU, side by side in one run, on builtin:llama-42m (or
--model): decode tokens/s at 8 rows (decode reads weights more than it computes) and at 64, greedy,
EOS ignored, for float32, int8 and int4 (and CTranslate2 int8 where it is installed: the bench
extra), and how many rows come out identical to float32's.

Then each engine's memory, each in a fresh process of its own (imports first, then the engine,
a few tokens): the resident memory the engine adds past the imports of torch, transformers (its
model code too, which any load imports) and the engine (VmHWM minus the RSS after them; the KV
pool of 1,024 tokens and the tokenizer are counted on every side), and the peak during the weights' load against the bound: the quantized weights + the
largest tensor in full precision + 10%.

Targets (issue 35): added memory int8 <= 0.7x and int4 <= 0.6x float32's; decode at 8 rows
int8 >= 1.3x and int4 >= 1.5x float32; int8 >= 1.5x CTranslate2 int8; load peak within the bound.

The same memory figures, with --checkpoints, for the model written as a GPTQ and a
compressed-tensors W4A16 checkpoint (the int4 bound) and a W8A8 one (int8's), each loaded as stored.

    .venv/bin/python scripts/bench_quant.py [--threads 2] [--rss-only] [--checkpoints] [--model DIR]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import random
import subprocess
import sys
import time
from pathlib import Path

METHODS = (None, "int8", "int4")


def status() -> dict[str, int]:
    fields = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent through fork and exec
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}


def run(model: str, quantization, prompts, max_tokens: int, rows: int):
    from engine import EngineConfig, LLMEngine, SamplingParams

    llm = LLMEngine(EngineConfig(model=model, quantization=quantization, max_num_seqs=rows, max_batch_tokens=16384))
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    seconds = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / seconds, [o.token_ids for o in outs], llm.runner.weights_nbytes


def ct2_rate(model: str, prompts, max_tokens: int, threads: int) -> float | None:
    spec = importlib.util.spec_from_file_location("ct2_reference", Path(__file__).parent / "ct2_reference.py")
    ct2 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ct2)
    if ct2.available() is not None:
        return None
    from engine import EngineConfig
    from engine.models import resolve_model_dir

    model_dir = resolve_model_dir(EngineConfig(model=model))
    out = ct2.convert(model_dir, Path.home() / ".cache" / "batchinfer" / "ct2" / model_dir.name)
    result = ct2.generate(out, prompts, [max_tokens] * len(prompts), threads=threads, max_batch_tokens=16384,
                          compute_type="int8")
    return result["generated_tokens"] / result["seconds"]


def rss_child(model: str, quantization: str | None) -> None:
    """In a fresh process: imports, then the engine, a few tokens; the memory figures as JSON."""
    import torch
    import transformers  # noqa: F401
    import transformers.modeling_utils  # noqa: F401  (the model code any load imports: scipy, triton, ...)

    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.models import resolve_model_dir
    from engine.quantization import SafetensorsFiles

    base = status()["VmRSS"]
    llm = LLMEngine(EngineConfig(model=model, quantization=quantization, max_batch_tokens=1024))
    llm.generate([[1, 5, 6, 7]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    now = status()
    files = SafetensorsFiles(resolve_model_dir(EngineConfig(model=model)))
    largest = max(4 * torch.Size(files.shape(n)).numel() for n in files.entries)  # float32, as the engine loads it
    print(json.dumps({"added_peak": now["VmHWM"] - base, "added": now["VmRSS"] - base,
                      "weights": llm.runner.weights_nbytes, "kv_pool": llm.memory["kv_bytes"],
                      "load_added_peak": llm.memory["load_peak_bytes"], "largest_tensor": largest,
                      "streamed": llm.runner.streamed}))


CHECKPOINTS = ("gptq", "compressed-tensors")
"""4-bit checkpoint formats --checkpoints writes (tests/engine/test_packed_checkpoints.py's writer),
beside a compressed-tensors W8A8 one (tests/engine/test_quantization.py's)."""


def write_checkpoints(model: str) -> dict[str, Path]:
    """The model written as a GPTQ, a compressed-tensors W4A16 and a W8A8 checkpoint, each once
    under ~/.cache/batchinfer/bench_quant; name -> directory."""
    from engine import EngineConfig
    from engine.models import resolve_model_dir

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))
    from test_packed_checkpoints import write
    from test_quantization import compressed_checkpoint

    src = resolve_model_dir(EngineConfig(model=model))
    root = Path.home() / ".cache" / "batchinfer" / "bench_quant" / src.name
    out = {}
    for fmt in CHECKPOINTS:
        path = root / fmt
        if not (path / "config.json").exists():
            write(fmt, src, path)
        out[f"{fmt} int4 checkpoint"] = path
    path = root / "w8a8"
    if not (path / "config.json").exists():
        compressed_checkpoint(src, path)
    out["compressed-tensors int8 checkpoint"] = path
    return out


def resident_memory(model: str, checkpoints: dict[str, Path]) -> None:
    rows = {}
    runs = [(q or "float32", model, q or "none") for q in METHODS] + [(k, str(v), "none") for k, v in checkpoints.items()]
    for name, path, quantization in runs:
        out = subprocess.run([sys.executable, __file__, "--model", path, "--rss-child", quantization],
                             capture_output=True, text=True, check=True).stdout
        rows[name] = json.loads(out.strip().splitlines()[-1])
    print("\n| engine | weights MiB (reported) | KV pool MiB | added RSS MiB | added peak MiB | load peak MiB | "
          "load bound MiB | within |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    f = rows["float32"]
    for name, r in rows.items():
        bound = 1.1 * (r["weights"] + r["largest_tensor"])
        print(f"| {name} | {r['weights'] / 2**20:.1f} | {r['kv_pool'] / 2**20:.1f} | {r['added'] / 2**20:.1f} | "
              f"{r['added_peak'] / 2**20:.1f} | {r['load_added_peak'] / 2**20:.1f} | {bound / 2**20:.1f} | "
              f"{'yes' if r['load_added_peak'] <= bound else 'NO'} |")
    targets = [("int8", 0.7), ("int4", 0.6)] + [(k, 0.7 if "int8" in k else 0.6) for k in checkpoints]
    for name, target in targets:
        q = rows[name]
        ratio = q["added_peak"] / f["added_peak"]
        print(f"{name} / float32: weights {q['weights'] / f['weights']:.2f}x, added peak memory {ratio:.2f}x "
              f"(target <= {target}: {'yes' if ratio <= target else 'NO'})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="builtin:llama-42m")
    ap.add_argument("--rss-only", action="store_true", help="only the memory table")
    ap.add_argument("--checkpoints", action="store_true",
                    help="also the memory of the model written as GPTQ, compressed-tensors W4A16 and W8A8 checkpoints")
    ap.add_argument("--rss-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rss_child:
        return rss_child(args.model, None if args.rss_child == "none" else args.rss_child)
    import torch

    torch.set_num_threads(args.threads)
    if not args.rss_only:
        rng = random.Random(0)
        print("| rows | float32 tok/s | int8 tok/s | int4 tok/s | CTranslate2 int8 tok/s | int8 / fp32 | int4 / fp32 | "
              "int8 / CT2 int8 | identical rows int8, int4 |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for rows, max_tokens in ((8, 96), (64, 48)):
            prompts = [[1] + [rng.randrange(3, 32000) for _ in range(rng.randint(16, 128))] for _ in range(rows)]
            got = {q: run(args.model, q, prompts, max_tokens, rows) for q in METHODS}
            ct2 = ct2_rate(args.model, prompts, max_tokens, args.threads)
            f_rate, f_tokens, _ = got[None]
            vs_ct2 = "-" if ct2 is None else f"{got['int8'][0] / ct2:.2f}x"
            same = [sum(a == b for a, b in zip(f_tokens, got[q][1])) for q in ("int8", "int4")]
            print(f"| {rows} | {f_rate:.1f} | {got['int8'][0]:.1f} | {got['int4'][0]:.1f} | "
                  f"{'-' if ct2 is None else f'{ct2:.1f}'} | {got['int8'][0] / f_rate:.2f}x | "
                  f"{got['int4'][0] / f_rate:.2f}x | {vs_ct2} | "
                  f"{same[0]}/{rows}, {same[1]}/{rows} |", flush=True)
    resident_memory(args.model, write_checkpoints(args.model) if args.checkpoints else {})


if __name__ == "__main__":
    main()
