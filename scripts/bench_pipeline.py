#!/usr/bin/env python
"""Pipeline overhead: the same workload through the bare engine and through a whole job.

Builds N text prompts (16-256 tokens, byte-level builtin model), max_tokens fixed, greedy,
ignore_eos, then measures in one run:
  1. the bare engine: LLMEngine.generate over all prompts (model already loaded);
  2. `batchinfer run` with one actor (Ray already started): JSONL in, Parquet parts out,
     manifest written. Timed from submission to manifest, actor start-up and model load
     included; Ray start-up is reported separately.
Prints a table with the pipeline's throughput as a fraction of the engine's.

    .venv/bin/python scripts/bench_pipeline.py [--requests 128] [--max-tokens 64] [--quick]
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from engine import EngineConfig, LLMEngine, SamplingParams
from jobs.spec import load_spec
from pipeline.run import ensure_ray, run_job
from pipeline.spec import Job

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()


def make_prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        target = rng.randint(16, 256)
        text = ""
        while len(text) < target - 1:  # byte tokenizer: ~1 token per byte, plus BOS
            text += rng.choice(WORDS) + " "
        prompts.append(text[: target - 1])
    return prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:llama-42m")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rows-per-batch", type=int, default=None, help="default: the spec's default")
    ap.add_argument("--max-batch-tokens", type=int, default=12288)
    ap.add_argument("--quick", action="store_true", help="32 requests, 16 tokens each (a smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.max_tokens = 32, 16
    prompts = make_prompts(args.requests, 0)
    work = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    (work / "in.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    spec = load_spec(None, [f"model={args.model}", f"engine.max_batch_tokens={args.max_batch_tokens}",
                            "engine.max_num_seqs=64", f"sampling.max_tokens={args.max_tokens}",
                            "sampling.temperature=0", "sampling.ignore_eos=true",
                            "workers.num=1"]
                     + ([f"workers.rows_per_batch={args.rows_per_batch}"] if args.rows_per_batch else []),
                     input=str(work / "in.jsonl"), output=str(work / "out"))
    print(f"workload: {len(prompts)} prompts of 16-256 tokens, max_tokens {args.max_tokens}, {args.model}, "
          f"max_batch_tokens {args.max_batch_tokens}, rows_per_batch {spec.workers.rows_per_batch}")

    t0 = time.perf_counter()
    llm = LLMEngine(EngineConfig(model=args.model, max_batch_tokens=args.max_batch_tokens, max_num_seqs=64))
    t_load = time.perf_counter() - t0
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    t_engine = time.perf_counter() - t0
    tokens_engine = sum(o.num_generated_tokens for o in outs)
    del llm

    t0 = time.perf_counter()
    ensure_ray(None)
    t_ray = time.perf_counter() - t0
    t0 = time.perf_counter()
    result = run_job(Job.of(spec), progress=lambda msg: None)
    t_job = time.perf_counter() - t0
    workers = result.manifest.workers
    t_shards = sum(w["seconds"] for w in workers.values())

    rate_engine = tokens_engine / t_engine
    rows = [("bare engine, model loaded beforehand", t_engine, tokens_engine),
            ("bare engine, model load included", t_engine + t_load, tokens_engine),
            ("batchinfer run, 1 actor (actor start + model load included)", t_job, result.generated_tokens),
            ("batchinfer run, time inside the actor's shards", t_shards, result.generated_tokens)]
    print("\n| path | seconds | generated tokens | tok/s | fraction of engine |\n|---|---:|---:|---:|---:|")
    for name, secs, toks in rows:
        print(f"| {name} | {secs:.1f} | {toks} | {toks / secs:.1f} | {toks / secs / rate_engine:.2f} |")
    print(f"\nRay start-up (not included above): {t_ray:.1f}s; job status {result.status}, rows {result.rows}")


if __name__ == "__main__":
    main()
