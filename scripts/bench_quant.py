#!/usr/bin/env python
"""int8 weights against float32 on CPU, side by side in one run: generated tokens/s at 8 rows
(decode reads weights more than it computes) and at 64 rows, on builtin:llama-42m, greedy,
EOS ignored, plus the weights' bytes each engine reports and how many rows come out identical.
Targets (issue 24): int8 >= 1.3x float32 at 8 rows; weights <= 0.6x.

    .venv/bin/python scripts/bench_quant.py [--threads 2]
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from engine import EngineConfig, LLMEngine, SamplingParams


def run(quantization, prompts, max_tokens: int, rows: int):
    llm = LLMEngine(EngineConfig(model="builtin:llama-42m", quantization=quantization, max_num_seqs=rows,
                                 max_batch_tokens=16384))
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    seconds = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / seconds, [o.token_ids for o in outs], llm.runner.weights_nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    print("| rows | float32 tok/s | int8 tok/s | int8 / float32 | identical rows | weights MiB fp32 / int8 |")
    print("|---:|---:|---:|---:|---:|---|")
    for rows, max_tokens in ((8, 96), (64, 48)):
        prompts = [[1] + [rng.randrange(3, 32000) for _ in range(rng.randint(16, 128))] for _ in range(rows)]
        f_rate, f_tokens, f_bytes = run(None, prompts, max_tokens, rows)
        q_rate, q_tokens, q_bytes = run("int8", prompts, max_tokens, rows)
        same = sum(a == b for a, b in zip(f_tokens, q_tokens))
        print(f"| {rows} | {f_rate:.1f} | {q_rate:.1f} | {q_rate / f_rate:.2f}x | {same}/{rows} | "
              f"{f_bytes / 2**20:.1f} / {q_bytes / 2**20:.1f} ({q_bytes / f_bytes:.2f}x) |", flush=True)


if __name__ == "__main__":
    main()
