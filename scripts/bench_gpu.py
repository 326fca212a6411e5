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


def build_model(out: Path) -> Path:
    """Random 1.2B Llama in bf16, made on the GPU and saved with the byte tokenizer."""
    if (out / "config.json").exists():
        return out
    tok = byte_tokenizer()
    config = LlamaConfig(**SHAPE, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    return out


def workload(n: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, SHAPE["vocab_size"]) for _ in range(rng.randint(64, 512))] for _ in range(n)]
    outputs = [rng.randint(32, 256) for _ in range(n)]
    return prompts, outputs


def run_engine(model_dir: Path, prompts, outputs, **config) -> tuple[float, list[list[int]], LLMEngine]:
    llm = LLMEngine(EngineConfig(model=str(model_dir), max_num_seqs=256, max_batch_tokens=196608, **config))
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in outputs]
    llm.generate(prompts[:8], params[:8])  # warm-up: pool allocation, first captures, kernels
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    return time.perf_counter() - start, [o.token_ids for o in outs], llm


def run_transformers(model_dir: Path, prompts, outputs, batch_size: int = 64) -> tuple[float, list[list[int]]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]), reverse=True)
    results: dict[int, list[int]] = {}
    torch.cuda.synchronize()
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
            g = model.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=new, min_new_tokens=new,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
        for r, i in enumerate(idx):
            results[i] = g[r, width:width + outputs[i]].tolist()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del model
    torch.cuda.empty_cache()
    return seconds, [results[i] for i in range(len(prompts))]


def profile_decode(llm: LLMEngine, rows: int = 256, steps: int = 48) -> dict:
    """Runs `rows` requests to steady decode, then profiles `steps` decode steps."""
    from torch.profiler import ProfilerActivity, profile

    rng = random.Random(1)
    for _ in range(rows):
        llm.add_request([rng.randrange(3, SHAPE["vocab_size"]) for _ in range(64)],
                        SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True))
    while llm.scheduler.has_work():
        llm.step()
    for _ in range(3):
        llm.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            llm.step()
        torch.cuda.synchronize()
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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="128 requests (a smoke run)")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--model-dir", help="where the random model is built (default: a temporary folder)")
    args = ap.parse_args()
    prompts, outputs = workload(128 if args.quick else 512)
    generated = sum(outputs)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(args.model_dir or tmp) / "llama-1.2b")
        rows = []
        t_static, static, llm = run_engine(model_dir, prompts, outputs, scheduling="static")
        rows.append(("engine static (CUDA graphs)", t_static, static))
        prof = profile_decode(llm)
        del llm
        t_cont, cont, _ = run_engine(model_dir, prompts, outputs, scheduling="continuous")
        rows.append(("engine continuous (CUDA graphs)", t_cont, cont))
        t_eager, eager, _ = run_engine(model_dir, prompts, outputs, scheduling="static", enforce_eager=True)
        rows.append(("engine static, enforce_eager", t_eager, eager))
        if not args.skip_transformers:
            t_hf, hf = run_transformers(model_dir, prompts, outputs)
            rows.append(("transformers generate, padded batches of 64, sorted", t_hf, hf))
    _, t_ref, ref = rows[-1]  # transformers, or the eager engine with --skip-transformers
    print(f"\n{len(prompts)} requests, {generated} generated tokens, 1.2B Llama bf16, {torch.cuda.get_device_name()}\n")
    print("| system | seconds | generated tok/s | vs last row | same tokens as last row |")
    print("|---|---:|---:|---:|---:|")
    for name, secs, toks in rows:
        print(f"| {name} | {secs:.2f} | {generated / secs:,.0f} | {t_ref / secs:.2f}x | {agreement(toks, ref)} |")
    print("\ndecode profile (engine static, 256 rows x 48 steps):")
    for k, v in prof.items():
        print(f"  {k}: {v:.3f}" if isinstance(v, float) else f"  {k}: {v}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "generated_tokens": generated, "requests": len(prompts),
            "systems": [{"name": n, "seconds": s, "tok_s": generated / s} for n, s, _ in rows],
            "profile": prof}, indent=2))


if __name__ == "__main__":
    main()
