#!/usr/bin/env python
"""The cost of n samples per prompt: n = 8 against n = 1 on the same prompts, in one run.

16 prompts of 512 random tokens, 16 new tokens each (temperature 1, seeded, EOS ignored), on
builtin:llama-42m, fp32, a 16,384-token KV pool, default engine settings otherwise. With n = 8
the prompt's blocks are computed once and shared by its 8 samples, so only decode grows (8x
the rows). Each run has prompts of its own (no blocks cached from the other). Checks that
sample 0 of an n = 8 request is the n = 1 output of the same seed.

Target (issue 22): n = 8 takes <= 2x the time of n = 1.

    .venv/bin/python scripts/bench_samples.py [--prompts 16] [--prompt-len 512] [--n 8] [--threads 2]
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from engine import EngineConfig, LLMEngine, SamplingParams

MODEL = "builtin:llama-42m"


def workload(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def run(llm: LLMEngine, prompts: list[list[int]], n: int, max_tokens: int):
    params = [SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, ignore_eos=True, seed=i)
              for i in range(len(prompts))]
    start = time.perf_counter()
    out = llm.generate(prompts, params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--budget", type=int, default=16384, help="max_batch_tokens: the KV pool's tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLMEngine(EngineConfig(model=MODEL, max_batch_tokens=args.budget, device=args.device))
    vocab = llm.runner.vocab_size
    run(llm, workload(2, 32, vocab, seed=9), 2, 2)  # warm-up (kernels), on other prompts
    # each run on prompts of its own, so that neither finds the other's prompt blocks cached
    t1, single = run(llm, workload(args.prompts, args.prompt_len, vocab, seed=1), 1, args.max_tokens)
    prompts = workload(args.prompts, args.prompt_len, vocab, seed=2)
    tn, sampled = run(llm, prompts, args.n, args.max_tokens)
    _, check = run(llm, prompts[:2], 1, args.max_tokens)
    same = all(s.samples[0].token_ids == o.token_ids for s, o in zip(sampled, check))
    tokens = sum(len(x.token_ids) for c in sampled for x in c.samples)
    print(f"{args.prompts} prompts x {args.prompt_len} tokens, {args.max_tokens} new tokens, max_batch_tokens "
          f"{args.budget}; {MODEL}, {args.device}, {torch.get_num_threads()} threads\n")
    print(f"| n | seconds | generated tokens | time vs n=1 |\n|---:|---:|---:|---:|\n"
          f"| 1 | {t1:.2f} | {sum(len(c.token_ids) for c in single)} | 1.00x |\n"
          f"| {args.n} | {tn:.2f} | {tokens} | {tn / t1:.2f}x |\n")
    print(f"sample 0 of an n={args.n} request equals its n=1 output (2 checked): {'yes' if same else 'NO'}; "
          f"target <= 2x: {'met' if tn <= 2 * t1 else 'NOT met'}")


if __name__ == "__main__":
    main()
