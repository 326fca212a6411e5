"""gpu_check.py's first stage: what a user's first job on a GPU meets, in about half a minute.

1. 16 prompts on builtin:tiny through LLMEngine on the GPU in float32, greedy, against the same
   engine on the CPU in float32: the tokens must be equal.
2. Every fast path's self-check (engine.runner.fast_paths) under strict_kernels, so a fallback
   fails the stage: the Triton decode and prefill kernels and one CUDA-graph replay against eager
   (float32 and bfloat16), and the int8 / int4 / fp8 GEMMs (fp8 where the card has it) on a
   tiny Qwen2, whose Q/K/V projections carry biases.
3. Each engine's first generate (kernels compiled, graphs captured) and second apart: the
   compilation is reported apart from the checks, and the checks' own seconds are summed.

Figures go to --json. Runs without Ray. `--device cpu` runs the same script on a CPU (against
itself: how it is tested without a GPU)."""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "engine")]

PROMPTS = [f"Prompt {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 4) for i in range(16)]


def run(config, params) -> tuple[list[list[int]], dict]:
    from engine import LLMEngine

    started = time.perf_counter()
    llm = LLMEngine(config)
    loaded = time.perf_counter()
    first = [c.token_ids for c in llm.generate(PROMPTS, params)]
    first_s = time.perf_counter() - loaded
    again = time.perf_counter()
    second = [c.token_ids for c in llm.generate(PROMPTS, params)]
    second_s = time.perf_counter() - again
    paths = llm.runner.paths
    facts = {"device": str(llm.runner.device), "dtype": str(llm.runner.dtype).removeprefix("torch."),
             "quantization": llm.runner.quantization, "fast_paths": paths.facts(),
             "check_seconds": round(sum(paths.check_seconds.values()), 3),
             "load_seconds": round(loaded - started, 2), "first_generate_seconds": round(first_s, 2),
             "second_generate_seconds": round(second_s, 2),
             "graphs_captured": getattr(llm.runner.graphs, "captures", 0), "repeatable": first == second}
    llm.close()
    return first, facts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import torch

    from engine import EngineConfig, FastPathError, SamplingParams
    from tiny_models import build_tiny_model

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu to try the script on a CPU")
        return 2
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    small = dict(max_batch_tokens=4096, max_num_seqs=16, block_size=16)  # never 0.9 of the card
    report: dict = {"engines": {}, "failures": []}
    cpu_tokens, report["engines"]["cpu float32"] = run(EngineConfig(model="builtin:tiny", device="cpu",
                                                                    dtype="float32", **small), params)
    cases = [("tiny float32", dict(model="builtin:tiny", dtype="float32")),
             ("tiny bfloat16", dict(model="builtin:tiny", dtype="bfloat16"))]
    with tempfile.TemporaryDirectory() as tmp:
        qwen2 = str(build_tiny_model("qwen2", Path(tmp) / "qwen2"))
        fp8 = args.device == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
        dtype = "bfloat16" if args.device == "cuda" else "float32"
        cases += [(f"qwen2 {m}", dict(model=qwen2, dtype=dtype, quantization=m))
                  for m in ("int8", "int4", *(("fp8",) if fp8 else ()))]
        for name, kw in cases:
            try:
                tokens, facts = run(EngineConfig(device=args.device, strict_kernels=True, **small, **kw), params)
            except FastPathError as exc:
                report["failures"].append(f"{name}: {exc}")
                print(f"FAIL {name}: {exc}", flush=True)
                continue
            report["engines"][name] = facts
            if name == "tiny float32":
                same = sum(a == b for a, b in zip(tokens, cpu_tokens))
                report["tiny_float32_same_as_cpu"] = f"{same}/{len(PROMPTS)}"
                if same != len(PROMPTS):
                    report["failures"].append(f"tiny float32 on {args.device}: {same}/{len(PROMPTS)} rows equal "
                                              "the CPU's greedy tokens")
            print(f"{name}: {json.dumps(facts)}", flush=True)
    report["check_seconds"] = round(sum(e["check_seconds"] for e in report["engines"].values()), 3)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "engines"}, indent=2))
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
