#!/usr/bin/env python
"""Generates completions for a few prompts with the engine and prints them with batch statistics.

    .venv/bin/python scripts/demo.py [--model builtin:tiny] [--max-tokens 24]
"""
from __future__ import annotations

import argparse
import time

from engine import EngineConfig, LLMEngine, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Translate to German: good morning",
    "def fibonacci(n):",
    "Once upon a time",
    "Q: What is 2 + 2?\nA:",
    "Les raisins de la colère — résumé :",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=EngineConfig.model)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--max-batch-tokens", type=int, default=EngineConfig.max_batch_tokens)
    args = ap.parse_args()

    start = time.perf_counter()
    llm = LLMEngine(EngineConfig(model=args.model, max_batch_tokens=args.max_batch_tokens))
    loaded = time.perf_counter()
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=0.0),
              SamplingParams(max_tokens=args.max_tokens, temperature=0.8, top_p=0.95, seed=1)] * 3
    outs = llm.generate(PROMPTS, params)
    done = time.perf_counter()

    print(f"model {args.model} on {llm.runner.device} ({llm.runner.dtype}), loaded in {loaded - start:.1f}s")
    if args.model.startswith("builtin:"):
        print("(builtin models have random weights: the text is noise, the pipeline is real)")
    for prompt, out in zip(PROMPTS, outs):
        print(f"\n> {prompt!r}\n  {out.text!r}\n  [{out.finish_reason}, {out.num_prompt_tokens} prompt + "
              f"{out.num_generated_tokens} generated tokens]")
    generated = sum(o.num_generated_tokens for o in outs)
    print(f"\n{len(outs)} completions, {generated} tokens in {done - loaded:.2f}s "
          f"({generated / (done - loaded):.0f} tok/s), batches: "
          + ", ".join(f"{s.rows} rows/{s.reserved_tokens} KV tokens" for s in llm.batch_stats))


if __name__ == "__main__":
    main()
