#!/usr/bin/env python
"""Prefix caching on vs off, side by side in one run, on a labeling-like workload.

48 requests share a 768-token prefix (instructions and few-shot examples), each followed by
a unique 16-48-token suffix, and generate 4 tokens (greedy, EOS ignored), on builtin:llama-42m,
fp32, CPU, default engine settings, in both scheduling modes. Also scores 3 choices per row
(`score_choices`, the label task's path). Checks that caching changes no token.

Target (issue 13): caching on >= 4x faster than off, with the same tokens.

    .venv/bin/python scripts/bench_prefix.py [--requests 48] [--prefix 768] [--threads 2] [--device cpu]
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from engine import EngineConfig, LLMEngine, SamplingParams

MODEL = "builtin:llama-42m"


def workload(n: int, prefix_len: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(3, vocab) for _ in range(rng.randint(16, 48))] for _ in range(n)]


def run(prompts, on: bool, mode: str, device: str, task: str):
    llm = LLMEngine(EngineConfig(model=MODEL, scheduling=mode, enable_prefix_caching=on, device=device))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate([prompts[0][:32]], params)  # warm-up (not sharing the prefix)
    start = time.perf_counter()
    if task == "generate":
        out = [o.token_ids for o in llm.generate(prompts, params)]
    else:
        out = [s.logprobs for s in llm.score_choices(prompts, [[[11], [12, 13], [14]]] * len(prompts))]
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    hit = llm.prefix_cache_hit_rate
    return seconds, out, hit


def same(a, b, task: str) -> bool:
    if task == "generate":
        return a == b
    return all(abs(x - y) <= 1e-3 for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--prefix", type=int, default=768)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = workload(args.requests, args.prefix, 32000)
    print(f"{args.requests} requests, {args.prefix}-token shared prefix + 16-48 unique tokens, 4 new tokens; "
          f"{MODEL}, {args.device}, {torch.get_num_threads()} threads\n")
    print("| task | mode | caching off s | caching on s | speed-up | prefix hit rate | same output |")
    print("|---|---|---:|---:|---:|---:|---|")
    for task, mode in (("generate", "static"), ("generate", "continuous"), ("score_choices", "static")):
        t_off, out_off, _ = run(prompts, False, mode, args.device, task)
        t_on, out_on, hit = run(prompts, True, mode, args.device, task)
        print(f"| {task} | {mode} | {t_off:.2f} | {t_on:.2f} | {t_off / t_on:.2f}x | {hit:.1%} "
              f"| {'yes' if same(out_on, out_off, task) else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
