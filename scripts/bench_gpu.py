#!/usr/bin/env python
"""GPU throughput: the engine (static, continuous, eager) against transformers, side by side,
plus a profile of decode steps (GPU busy time, syncs and launches per step).

Model: Llama-shaped 1.2B with random weights (hidden 2048, 16 layers, 32 heads / 8 KV heads,
ffn 8192, vocab 16384), bf16, built on the GPU at start (no download). Workload: 512 requests,
all at t=0, prompts of 64-512 random tokens, outputs of 32-256 tokens, greedy, EOS ignored;
engine max_num_seqs=256, max_batch_tokens=196608.

Targets (issue 11): >= 15,000 generated tok/s; >= 12x transformers padded batches; GPU busy
>= 70% of decode wall time; continuous >= static.

    python scripts/bench_gpu.py [--quick] [--json OUT.json] [--skip-transformers]
    python scripts/bench_gpu.py --smoke    # the script's own check on CPU: tiny shape, 16 requests

Each system's line is printed as soon as it finishes, so a run cut short still reports.
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.builtin import byte_tokenizer

SHAPE = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, vocab_size=16384, max_position_embeddings=2048)
SMOKE_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048)
DEVICE = "cuda"
DTYPE = "bfloat16"  # float32 in --smoke, where exact agreement with transformers is expected


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def build_model(out: Path, shape: dict) -> Path:
    """Random Llama in bf16, made on the device and saved with the byte tokenizer."""
    if (out / "config.json").exists():
        return out
    tok = byte_tokenizer()
    config = LlamaConfig(**shape, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, DTYPE))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    del model
    return out


def workload(n: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(64, 512))] for _ in range(n)]
    outputs = [rng.randint(32, 256) for _ in range(n)]
    return prompts, outputs


def run_engine(model_dir: Path, prompts, outputs, repeat: bool = False, **config):
    """Times the workload through one engine: -> (seconds, tokens, engine, phases). The engine
    has run 8 requests first (pool allocation, first kernels). With `repeat`, the workload runs
    twice and the second run is the one timed (every graph it needs was captured by the first,
    as a long job's steady state has them); `phases` reports both."""
    llm = LLMEngine(EngineConfig(model=str(model_dir), device=DEVICE, dtype=DTYPE, max_num_seqs=256,
                                 max_batch_tokens=196608, **config))
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in outputs]
    # The warm-up and the first of two runs see other tokens of the same lengths: the prefix
    # cache must not serve the timed run from them.
    other = [[(t * 7 + 1) % (llm.runner.vocab_size - 3) + 3 for t in p] for p in prompts]
    llm.generate(other[:8], params[:8])
    prefill = timed(llm.runner, "prefill")
    phases = []
    for run in ([other, prompts] if repeat else [prompts]):
        graphs = llm.runner.graphs
        captures, capture_s = (graphs.captures, graphs.capture_seconds) if graphs else (0, 0.0)
        prefill["seconds"], prefill["calls"], done = 0.0, 0, len(llm.batch_stats)
        sync()
        start = time.perf_counter()
        outs = llm.generate(run, params)
        sync()
        seconds = time.perf_counter() - start
        stats = llm.batch_stats[done:]
        phases.append({"seconds": round(seconds, 3), "prefill_passes": prefill["calls"],
                       "prefill_s": round(prefill["seconds"], 3),
                       "decode_steps": sum(b.decode_steps for b in stats),
                       "graph_captures": graphs.captures - captures if graphs else 0,
                       "capture_s": round(graphs.capture_seconds - capture_s, 3) if graphs else 0.0})
    return seconds, [o.token_ids for o in outs], llm, phases


def timed(obj, name: str) -> dict:
    """Wraps obj.<name> to add its synchronized wall time and call count to the returned dict."""
    method, acc = getattr(obj, name), {"seconds": 0.0, "calls": 0}

    def wrapper(*args, **kwargs):
        sync()
        t = time.perf_counter()
        out = method(*args, **kwargs)
        sync()
        acc["seconds"] += time.perf_counter() - t
        acc["calls"] += 1
        return out
    setattr(obj, name, wrapper)
    return acc


def run_transformers(model_dir: Path, prompts, outputs, batch_size: int = 64) -> tuple[float, list[list[int]]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, DTYPE)).to(DEVICE).eval()
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]), reverse=True)
    results: dict[int, list[int]] = {}
    sync()
    start = time.perf_counter()
    for a in range(0, len(order), batch_size):
        idx = order[a:a + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.zeros((len(idx), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(idx):  # left padding, as generate() wants
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        new = max(outputs[i] for i in idx)
        with torch.inference_mode():
            g = model.generate(ids.to(DEVICE), attention_mask=mask.to(DEVICE), max_new_tokens=new, min_new_tokens=new,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
        for r, i in enumerate(idx):
            results[i] = g[r, width:width + outputs[i]].tolist()
    sync()
    seconds = time.perf_counter() - start
    del model
    return seconds, [results[i] for i in range(len(prompts))]


def profile_decode(llm: LLMEngine, rows: int = 256, steps: int = 48) -> dict:
    """Runs `rows` requests to steady decode, then profiles `steps` decode steps."""
    from torch.profiler import ProfilerActivity, profile

    rng = random.Random(1)
    for _ in range(rows):
        llm.add_request([rng.randrange(3, llm.runner.vocab_size) for _ in range(64)],
                        SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True))
    while llm.scheduler.has_work():
        llm.step()
    for _ in range(3):
        llm.step()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            llm.step()
        sync()
        wall = time.perf_counter() - start
    while llm.has_unfinished():
        llm.step()
    stats = prof.key_averages()
    kernel_us = sum(k.self_device_time_total for k in stats)  # every kernel and copy on the GPU
    counts = {k.key: k.count for k in stats}

    def count(name: str) -> int:
        return counts.get(name, 0)

    return {"rows": rows, "steps": steps, "wall_ms_per_step": 1e3 * wall / steps,
            "gpu_busy": kernel_us / 1e6 / wall,
            "syncs_per_step": count("cudaStreamSynchronize") / steps,
            "memcpy_calls_per_step": count("cudaMemcpyAsync") / steps,
            "kernel_launches_per_step": count("cudaLaunchKernel") / steps,
            "graph_launches_per_step": count("cudaGraphLaunch") / steps}


def agreement(a, b) -> str:
    return f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"


def main() -> None:
    global DEVICE, DTYPE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="128 requests (a smoke run)")
    ap.add_argument("--smoke", action="store_true", help="check the script itself on CPU: tiny model, 16 requests")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--skip-eager", action="store_true", help="leave out the enforce_eager row")
    ap.add_argument("--json", help="write the results here (rewritten after each system)")
    ap.add_argument("--model-dir", help="where the random model is built (default: a temporary folder)")
    args = ap.parse_args()
    shape, n = (SMOKE_SHAPE, 16) if args.smoke else (SHAPE, 128 if args.quick else 512)
    if args.smoke:
        DEVICE, DTYPE = "cpu", "float32"
    prompts, outputs = workload(n, shape["vocab_size"])
    generated = sum(outputs)
    name = "tiny Llama (smoke)" if args.smoke else "1.2B Llama bf16"
    where = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU"
    print(f"{len(prompts)} requests, {generated} generated tokens, {name}, {where}", flush=True)
    rows: list[tuple[str, float, list[list[int]]]] = []
    prof: dict = {}

    def report(label: str, secs: float, toks) -> None:
        rows.append((label, secs, toks))
        print(f"  {label}: {secs:.2f} s, {generated / secs:,.0f} generated tok/s", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({
                "generated_tokens": generated, "requests": len(prompts), "device": where, "model": name,
                "systems": [{"name": n, "seconds": s, "tok_s": generated / s} for n, s, _ in rows],
                "profile": prof}, indent=2))

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(args.model_dir or tmp) / "llama", shape)
        for mode in ("static", "continuous"):
            t, toks, llm, phases = run_engine(model_dir, prompts, outputs, repeat=True, scheduling=mode)
            print(f"  engine {mode}: first run (captures graphs) {phases[0]}", flush=True)
            print(f"  engine {mode}: second run (timed)          {phases[1]}", flush=True)
            prof[f"{mode}_runs"] = phases
            if mode == "static":
                prof.update(profile_decode(llm, rows=min(256, n * 16), steps=48))
                print("  decode profile (engine static):", ", ".join(
                    f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in prof.items()
                    if not k.endswith("_runs")), flush=True)
            del llm
            report(f"engine {mode} (CUDA graphs)", t, toks)
        if not args.skip_transformers:
            t, toks = run_transformers(model_dir, prompts, outputs)
            report("transformers generate, padded batches of 64, sorted", t, toks)
        if not args.skip_eager:
            t, toks, _, _ = run_engine(model_dir, prompts, outputs, scheduling="static", enforce_eager=True)
            report("engine static, enforce_eager", t, toks)
    ref_name, t_ref, ref = rows[2] if not args.skip_transformers else rows[0]
    print(f"\n{len(prompts)} requests, {generated} generated tokens, {name}, {where}\n")
    print(f"| system | seconds | generated tok/s | speed vs {ref_name.split(',')[0]} | same tokens |")
    print("|---|---:|---:|---:|---:|")
    for label, secs, toks in rows:
        print(f"| {label} | {secs:.2f} | {generated / secs:,.0f} | {t_ref / secs:.2f}x | {agreement(toks, ref)} |")
    print("\ndecode profile (engine static, 256 rows x 48 steps) and engine runs:")
    for k, v in prof.items():
        print(f"  {k}: {v:.3f}" if isinstance(v, float) else f"  {k}: {v}")


if __name__ == "__main__":
    main()
