#!/usr/bin/env python
"""int8 weights against float32 on CPU, side by side in one run: generated tokens/s at 8 rows
(decode reads weights more than it computes) and at 64 rows, on builtin:llama-42m, greedy,
EOS ignored, plus the weights' bytes each engine reports and how many rows come out identical.
Then each engine's resident memory, measured in a fresh process of its own (the model loaded,
a few tokens generated): peak and current RSS, beside the weights' bytes it reports.
Targets (issue 24): int8 >= 1.3x float32 at 8 rows; weights <= 0.6x.

    .venv/bin/python scripts/bench_quant.py [--threads 2] [--rss-only]
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
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


def rss_child(quantization: str | None) -> None:
    """In a fresh process: load, generate a little, print the resident memory as JSON."""
    llm = LLMEngine(EngineConfig(model="builtin:llama-42m", quantization=quantization, max_batch_tokens=4096))
    llm.generate([[1, 5, 6, 7]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent through fork and exec
    print(json.dumps({"peak_rss": int(status["VmHWM"].split()[0]) * 1024, "rss": int(status["VmRSS"].split()[0]) * 1024, "weights": llm.runner.weights_nbytes,
                      "kv_pool": llm.memory["kv_bytes"]}))


def resident_memory() -> None:
    rows = {}
    for quantization in (None, "int8"):
        out = subprocess.run([sys.executable, __file__, "--rss-child", quantization or "none"], capture_output=True,
                             text=True, check=True).stdout
        rows[quantization or "float32"] = json.loads(out.strip().splitlines()[-1])
    print("\n| engine | weights MiB (reported) | KV pool MiB | RSS MiB | peak RSS MiB |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['weights'] / 2**20:.1f} | {r['kv_pool'] / 2**20:.1f} | {r['rss'] / 2**20:.1f} | "
              f"{r['peak_rss'] / 2**20:.1f} |")
    f, q = rows["float32"], rows["int8"]
    print(f"\nint8 / float32: weights {q['weights'] / f['weights']:.2f}x, RSS {q['rss'] / f['rss']:.2f}x, "
          f"peak RSS {q['peak_rss'] / f['peak_rss']:.2f}x (RSS holds torch, the tokenizer and the process's "
          "buffers besides the weights)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rss-only", action="store_true", help="only the resident-memory table")
    ap.add_argument("--rss-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.rss_child:
        return rss_child(None if args.rss_child == "none" else args.rss_child)
    if args.rss_only:
        return resident_memory()
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
    resident_memory()


if __name__ == "__main__":
    main()
