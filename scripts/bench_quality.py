#!/usr/bin/env python
"""Quantized against float32 on real weights (issue 46): SmolLM2-135M-Instruct's greedy outputs for
the 32 chat prompts of tests/data/smollm2_greedy.json (64 tokens, EOS ignored) with int8 and int4,
each against the engine's float32: how many outputs are identical, and the mean common prefix in
tokens. tests/engine/test_real_models.py holds the floors below these figures.

    .venv/bin/python scripts/bench_quality.py [--methods int8,int4]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from engine import EngineConfig, LLMEngine, SamplingParams

MODEL = "builtin:smollm2-135m-instruct"
DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "smollm2_greedy.json"


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(method: str | None, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], float]:
    llm = LLMEngine(EngineConfig(model=MODEL, max_batch_tokens=8192, quantization=method))
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2))
    started = time.perf_counter()
    out = [o.token_ids for o in llm.generate(prompts, params)]
    return out, time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="int8,int4")
    args = ap.parse_args()
    refs = json.loads(DATA.read_text())
    prompts = [r["prompt_token_ids"] for r in refs["rows"]]
    base, t_base = agreement(None, prompts, refs["max_tokens"])
    print(f"{len(prompts)} chat prompts x {refs['max_tokens']} tokens, greedy; float32 {t_base:.1f}s\n")
    print("| method | identical to float32 | mean common prefix (tokens) | seconds | vs float32 |")
    print("|---|---:|---:|---:|---:|")
    for method in args.methods.split(","):
        got, secs = agreement(method, prompts, refs["max_tokens"])
        same = sum(a == b for a, b in zip(base, got))
        prefix = sum(common_prefix(a, b) for a, b in zip(base, got)) / len(prompts)
        print(f"| {method} | {same}/{len(prompts)} | {prefix:.1f} | {secs:.1f} | {t_base / secs:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
