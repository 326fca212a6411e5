#!/usr/bin/env python
"""KV memory on the jobs users run: rows at once in a fixed pool, and continuous vs static.

Side by side in one run, on builtin:tiny (CPU, float32), each case checked token for token
against a pool that holds everything at once:

  1. early stops: 128 requests, 32-token prompts, max_tokens 512, each stopping after 3-220
     tokens (~47 on average) at a stop token picked from its own greedy continuation, in an
     8,192-token pool with max_num_seqs 64. Target (issue 20): >= 48 rows at once.
  2. shared prefix: 64 requests sharing a 1,024-token prefix (+16 unique tokens, 16 new
     tokens), same pool. Target: >= 48 rows at once.
  3. mixed output lengths (16-512) on 48 requests, builtin:llama-42m: continuous vs static
     generated tokens/s at the same pool. Target: >= 1.3x.
  4. case 3's requests through the scheduler alone (no model, deterministic): forward passes,
     decode rows per pass, prompt tokens computed and preemptions of static, continuous,
     continuous told every output length up front (growth 1 from the start: what any
     admission policy could know at best) and continuous in a pool that holds everything.

    .venv/bin/python scripts/bench_kv.py [--cases 1,2,3,4] [--threads 2] [--repeats 3]
"""
from __future__ import annotations

import argparse
import random
import time

import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.core import BlockPool, Scheduler, Sequence


def peak(llm: LLMEngine) -> tuple[int, int, int]:
    """(peak rows, most KV tokens in use, preemptions) over the engine's batches."""
    st = llm.batch_stats
    return max(s.peak_rows for s in st), max(s.reserved_tokens for s in st), sum(s.preemptions for s in st)


def early_stops(mode: str) -> dict:
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(3, 259) for _ in range(31)] for _ in range(128)]
    lengths = [min(220, max(3, int(rng.expovariate(1 / 44)))) for _ in prompts]
    roomy = LLMEngine(EngineConfig(model="builtin:tiny", max_batch_tokens=128 * 560, max_num_seqs=128,
                                   scheduling=mode))
    free = roomy.generate(prompts, SamplingParams(max_tokens=512, temperature=0, ignore_eos=True))
    params = [SamplingParams(max_tokens=512, temperature=0, ignore_eos=True, stop_token_ids=[o.token_ids[n - 1]])
              for o, n in zip(free, lengths)]
    want = [o.token_ids for o in roomy.generate(prompts, params)]
    llm = LLMEngine(EngineConfig(model="builtin:tiny", max_batch_tokens=8192, max_num_seqs=64, scheduling=mode))
    got = [o.token_ids for o in llm.generate(prompts, params)]
    rows, kv, pre = peak(llm)
    return dict(case="early stops", mode=mode, peak_rows=rows, kv_tokens=kv, preemptions=pre,
                mean_output=sum(map(len, got)) / len(got), identical=got == want)


def shared_prefix(mode: str) -> dict:
    rng = random.Random(1)
    prefix = [1] + [rng.randrange(3, 259) for _ in range(1023)]
    prompts = [prefix + [rng.randrange(3, 259) for _ in range(16)] for _ in range(64)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in LLMEngine(EngineConfig(model="builtin:tiny", max_batch_tokens=64 * 1100,
                                                        max_num_seqs=64, scheduling=mode)).generate(prompts, params)]
    llm = LLMEngine(EngineConfig(model="builtin:tiny", max_batch_tokens=8192, max_num_seqs=64, scheduling=mode))
    got = [o.token_ids for o in llm.generate(prompts, params)]
    rows, kv, pre = peak(llm)
    return dict(case="shared 1k prefix", mode=mode, peak_rows=rows, kv_tokens=kv, preemptions=pre,
                cached=sum(s.cached_prompt_tokens for s in llm.batch_stats), identical=got == want)


def mixed_workload() -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(2)
    prompts = [[1] + [rng.randrange(3, 32000) for _ in range(rng.randint(16, 128))] for _ in range(48)]
    params = [SamplingParams(max_tokens=rng.randint(16, 512), temperature=0, ignore_eos=True) for _ in prompts]
    return prompts, params


def mixed_lengths(repeats: int) -> list[dict]:
    """Static, then continuous, `repeats` times interleaved; each mode's fastest run counts (on
    a shared machine other load only ever adds time)."""
    prompts, params = mixed_workload()
    engines = {mode: LLMEngine(EngineConfig(model="builtin:llama-42m", max_batch_tokens=8192, max_num_seqs=32,
                                            scheduling=mode)) for mode in ("static", "continuous")}
    for llm in engines.values():
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    best, tokens, stats = {}, {}, {}
    for _ in range(repeats):
        for mode, llm in engines.items():
            llm.batch_stats.clear()
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            seconds = time.perf_counter() - start
            tokens[mode] = [o.token_ids for o in outs]
            stats[mode] = peak(llm)
            best[mode] = min(best.get(mode, seconds), seconds)
    out = []
    for mode in engines:
        rows, kv, pre = stats[mode]
        out.append(dict(case="mixed outputs 16-512 (42m)", mode=mode, seconds=round(best[mode], 2),
                        tok_s=round(sum(map(len, tokens[mode])) / best[mode], 1), peak_rows=rows, kv_tokens=kv,
                        preemptions=pre))
    out[1]["vs_static"] = round(out[1]["tok_s"] / out[0]["tok_s"], 2)
    out[1]["identical"] = tokens["static"] == tokens["continuous"]
    return out


def simulated(mode: str, pool_tokens: int = 8192, known_lengths: bool = False) -> dict:
    """Case 3's requests through the scheduler alone, each sampled row taking one token."""
    prompts, params = mixed_workload()
    s = Scheduler(BlockPool(pool_tokens // 16, 16), 32, max_model_len=4096, max_num_batched_tokens=1024,
                  continuous=mode == "continuous", salt=b"sim")
    if known_lengths:
        s.growth = 1.0  # every row is expected to use all its max_tokens (it does: ignore_eos)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        s.add(Sequence(index=i, prompt_token_ids=list(prompt), params=p, seed=0))
    passes = decode = prefill = 0
    while s.has_work():
        step = s.schedule()
        s.update(step)
        rows = sum(c.count == 1 and c.start >= c.seq.num_prompt_tokens for c in step.chunks)
        passes, decode, prefill = passes + 1, decode + rows, prefill + step.num_tokens - rows
        done = []
        for c in step.chunks:
            if c.samples:
                c.seq.output_token_ids.append(3)
                if c.seq.num_output_tokens >= c.seq.params.max_tokens:
                    c.seq.finish("length")
                    done.append(c.seq)
        s.finish(done)
        if known_lengths:
            s.growth = 1.0
    name = mode + (", lengths known" if known_lengths else "") + (f", pool {pool_tokens}" if pool_tokens != 8192 else "")
    return dict(case="simulated 16-512", policy=name, passes=passes, decode_rows_per_pass=round(decode / passes, 1),
                prompt_tokens_computed=prefill, preemptions=s.preemptions)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="1,2,3,4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved runs of case 3 (the fastest counts)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cases = set(args.cases.split(","))
    rows = []
    for mode in ("static", "continuous"):
        if "1" in cases:
            rows.append(early_stops(mode))
        if "2" in cases:
            rows.append(shared_prefix(mode))
    if "3" in cases:
        rows += mixed_lengths(args.repeats)
    if "4" in cases:
        rows += [simulated("static"), simulated("continuous"), simulated("continuous", known_lengths=True),
                 simulated("continuous", pool_tokens=32 * 640)]
    for r in rows:
        print("  ".join(f"{k}={v}" for k, v in r.items()), flush=True)


if __name__ == "__main__":
    main()
