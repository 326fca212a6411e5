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

The 8B workload (issue 21), `--workload 8b`: a Llama-3-8B shape (hidden 4096, 32 layers, 32 /
8 KV heads, ffn 14336, vocab 128,256), bf16, random weights built on the local disk; 512
requests at t=0, each a shared 256-token system prefix plus 256-1,280 unique tokens,
max_tokens 256-768, greedy, EOS ignored. The engine (static, continuous; the KV pool sized by
gpu_memory_utilization) runs one untimed warm-up on a slice, then the timed run, against
transformers' padded batches and its continuous batching (`generate_batch`) on a subset. The
script prints the workload's limit by this rule, over the passes the engine actually ran:
a pass's decode rows cost the larger of their bytes (the weights, plus the KV each row reads at
its length) over 4.3 TB/s and their FLOPs over 790 TFLOP/s; its prefill tokens cost their FLOPs
over 790 TFLOP/s; the limit is the sum. Targets: >= 8,000 generated tok/s and >= 60% of the
limit; continuous >= static.

    python scripts/bench_gpu.py --workload 8b [--json OUT.json] [--subset 32]

Quantized (issue 35), `--quantization int8,int4,fp8`: the 1.2B workload through the static
engine in bf16 and then with each method (fp8 where the card has fp8 matmuls), side by side:
generated tok/s, the share of rows whose greedy tokens equal bf16's (a random model's near-ties
flip under any rounding), the weights' bytes, and the device memory the load added at its peak
against the bound of the quantized weights + the largest tensor in bf16 + 10%.

    python scripts/bench_gpu.py --quick --quantization int8,int4,fp8 [--json OUT.json]
    python scripts/bench_gpu.py --workload 8b --smoke     # on CPU: tiny shape, lengths / 16

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
from engine.models import byte_tokenizer

SHAPE = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, vocab_size=16384, max_position_embeddings=2048)
SMOKE_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048)
SHAPE_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096, rope_theta=500000.0)
HBM_BYTES_S = 4.3e12
"""H200: bytes per second the weights and KV can be read at."""
PEAK_FLOPS = 790e12
"""H200: dense bf16 FLOP/s reached by large GEMMs."""
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
    prefill = timed_prefill(llm.runner)
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
                       "capture_s": round(graphs.capture_seconds - capture_s, 3) if graphs else 0.0,
                       "graphs": bool(graphs and not graphs.failed), "graphs_failed": bool(graphs and graphs.failed)})
    return seconds, [o.token_ids for o in outs], llm, phases


def timed_prefill(runner) -> dict:
    """Wraps runner.run to add the synchronized wall time and count of the passes that carry
    prompt tokens (with decode rows beside them, in mixed passes) to the returned dict."""
    run, acc = runner.run, {"seconds": 0.0, "calls": 0}

    def wrapper(cache, chunks, *args, **kwargs):
        if not any(c.start < c.seq.num_prompt_tokens for c in chunks):
            return run(cache, chunks, *args, **kwargs)
        sync()
        t = time.perf_counter()
        out = run(cache, chunks, *args, **kwargs)
        sync()
        acc["seconds"] += time.perf_counter() - t
        acc["calls"] += 1
        return out
    runner.run = wrapper
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
    while llm.scheduler.has_waiting():  # every row admitted and prefilled: the steps left are decode
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
    # every kernel and copy on the GPU, once: the profiler also credits each kernel's time to the
    # CPU op that launched it, so only the device's own events are summed
    kernel_us = sum(k.self_device_time_total for k in stats if k.device_type == torch.autograd.DeviceType.CUDA)
    counts = {k.key: k.count for k in stats}

    def count(name: str) -> int:
        return counts.get(name, 0)

    return {"rows": rows, "steps": steps, "wall_ms_per_step": 1e3 * wall / steps,
            "gpu_busy": kernel_us / 1e6 / wall,
            "syncs_per_step": count("cudaStreamSynchronize") / steps,
            "memcpy_calls_per_step": count("cudaMemcpyAsync") / steps,
            # Triton launches through the driver API, torch's kernels through the runtime's
            "kernel_launches_per_step": sum(map(count, ("cudaLaunchKernel", "cuLaunchKernelEx", "cuLaunchKernel"))) / steps,
            "graph_launches_per_step": count("cudaGraphLaunch") / steps}


def agreement(a, b) -> str:
    return f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"


def main_quantized(args, shape: dict, n: int) -> None:
    """bf16 against each method of --quantization on the 1.2B workload (static engine)."""
    from engine.quantization import SafetensorsFiles

    methods = [m for m in args.quantization.split(",") if m]
    if "fp8" in methods and (DEVICE != "cuda" or torch.cuda.get_device_capability() < (8, 9)):
        print("  fp8 left out: no fp8 matmuls on this device", flush=True)
        methods.remove("fp8")
    prompts, outputs = workload(n, shape["vocab_size"])
    generated = sum(outputs)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(args.model_dir or tmp) / "llama", shape)
        files = SafetensorsFiles(model_dir)
        largest = max(2 * torch.Size(files.shape(name)).numel() for name in files.entries)  # bf16
        for method in [None, *methods]:
            t, toks, llm, _ = run_engine(model_dir, prompts, outputs, scheduling="static", quantization=method)
            mem = llm.memory
            bound = 1.1 * (mem["weights_bytes"] + largest)
            rows.append({"method": method or {"bfloat16": "bf16"}.get(DTYPE, DTYPE), "seconds": t, "tok_s": generated / t, "tokens": toks,
                         "weights_bytes": mem["weights_bytes"], "load_peak_bytes": mem["load_peak_bytes"],
                         "bound_bytes": bound, "streamed": mem.get("streamed", False)})
            print(f"  {rows[-1]['method']}: {t:.2f} s, {generated / t:,.0f} generated tok/s, weights "
                  f"{mem['weights_bytes'] / 2**20:,.1f} MiB, load peak {mem['load_peak_bytes'] / 2**20:,.1f} MiB "
                  f"(bound {bound / 2**20:,.1f})", flush=True)
            del llm
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
            if args.json:
                Path(args.json).write_text(json.dumps({"generated_tokens": generated, "requests": len(prompts),
                                                       "systems": [{k: v for k, v in r.items() if k != "tokens"}
                                                                   for r in rows]}, indent=2))
    base = rows[0]
    print(f"\n{len(prompts)} requests, {generated} generated tokens, {'tiny Llama (smoke)' if args.smoke else '1.2B Llama'}"
          f", static engine\n")
    print(f"| method | seconds | generated tok/s | vs {base['method']} | same tokens as {base['method']} | weights MiB "
          "| load peak MiB | bound MiB | within |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        within = "—" if r is base else ("yes" if r["load_peak_bytes"] <= r["bound_bytes"] else "NO")
        print(f"| {r['method']} | {r['seconds']:.2f} | {r['tok_s']:,.0f} | {r['tok_s'] / base['tok_s']:.2f}x | "
              f"{agreement(r['tokens'], base['tokens'])} | {r['weights_bytes'] / 2**20:,.1f} | "
              f"{r['load_peak_bytes'] / 2**20:,.1f} | {r['bound_bytes'] / 2**20:,.1f} | {within} |")


def workload_8b(n: int, vocab: int, scale: int = 1, seed: int = 0):
    """A shared 256-token system prefix plus 256-1,280 unique tokens each, max_tokens 256-768
    (every length divided by `scale`)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(256 // scale)]
    prompts = [prefix + [rng.randrange(3, vocab) for _ in range(rng.randint(256, 1280) // scale)] for _ in range(n)]
    outputs = [rng.randint(256, 768) // scale for _ in range(n)]
    return prompts, outputs


def record_passes(runner) -> list[tuple[int, int, int, int, int]]:
    """Wraps runner.run to log each forward pass as (decode rows, positions those rows read,
    prefill tokens, (query, key) pairs of the prefill tokens' attention, rows sampled)."""
    log, run = [], runner.run

    def wrapper(cache, chunks, *args, **kwargs):
        rows = ctx = tokens = pairs = 0
        for c in chunks:
            if c.count == 1 and c.start >= c.seq.num_prompt_tokens:  # a decode row: one token over its row
                rows, ctx = rows + 1, ctx + c.start + 1
            else:  # prompt tokens start..start+count, each over the positions up to its own
                tokens, pairs = tokens + c.count, pairs + c.count * c.start + c.count * (c.count + 1) // 2
        log.append((rows, ctx, tokens, pairs, sum(c.samples for c in chunks)))
        return run(cache, chunks, *args, **kwargs)
    runner.run = wrapper
    return log


def limit_seconds(passes, shape: dict, dtype_bytes: int = 2) -> dict:
    """The workload's limit over the passes run (see the module's rule), for a Llama `shape`."""
    h, layers, heads = shape["hidden_size"], shape["num_hidden_layers"], shape["num_attention_heads"]
    kv_heads, ffn, vocab = shape["num_key_value_heads"], shape["intermediate_size"], shape["vocab_size"]
    hd = h // heads
    body = layers * (2 * h * heads * hd + 2 * h * kv_heads * hd + 3 * h * ffn)  # matmul weights per token
    head = h * vocab  # the LM head, for sampled rows only
    weights = (body + head) * dtype_bytes  # read once per pass (embedding lookups read a row each)
    kv_per_position = 2 * layers * kv_heads * hd * dtype_bytes
    attention = 4 * layers * heads * hd  # FLOPs per (query, key) pair: scores and values
    decode_s = prefill_s = 0.0
    for rows, ctx, tokens, pairs, sampled in passes:
        decode_sampled = min(rows, sampled)
        if rows:
            flops = 2 * body * rows + 2 * head * decode_sampled + attention * ctx
            decode_s += max((weights + ctx * kv_per_position) / HBM_BYTES_S, flops / PEAK_FLOPS)
        if tokens:
            prefill_s += (2 * body * tokens + 2 * head * (sampled - decode_sampled) + attention * pairs) / PEAK_FLOPS
    return {"seconds": decode_s + prefill_s, "decode_s": decode_s, "prefill_s": prefill_s, "passes": len(passes)}


def run_transformers_batch(model_dir: Path, prompts, outputs) -> tuple[float, list[list[int]]]:
    """transformers' own continuous batching (`generate_batch`, paged attention), one call."""
    from transformers import GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, DTYPE),
                                                 attn_implementation="paged|sdpa").to(DEVICE).eval()
    config = GenerationConfig(max_new_tokens=max(outputs), do_sample=False, eos_token_id=-1, pad_token_id=0)
    with torch.inference_mode():  # untimed: its own warm-up (kernels, the paged cache) on two short requests
        model.generate_batch([list(p[:16]) for p in prompts[:2]], generation_config=GenerationConfig(
            max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0), progress_bar=False)
    sync()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate_batch([list(p) for p in prompts], generation_config=config, progress_bar=False,
                                   warmup=False)
    sync()
    seconds = time.perf_counter() - start
    del model
    ordered = [out[k].generated_tokens for k in sorted(out, key=lambda k: int(k.rsplit("_", 1)[1]))]
    return seconds, [toks[:m] for toks, m in zip(ordered, outputs)]


def main_8b(args) -> None:
    """The 8B workload: the engine's two modes against transformers on a subset, and the limit."""
    import gc

    shape, n, scale = (SMOKE_SHAPE, 24, 16) if args.smoke else (SHAPE_8B, 512, 1)
    prompts, outputs = workload_8b(n, shape["vocab_size"], scale)
    generated = sum(outputs)
    where = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU"
    name = "tiny Llama, lengths / 16 (smoke)" if args.smoke else "Llama-3-8B shape bf16"
    print(f"{n} requests, {sum(map(len, prompts))} prompt tokens ({256 // scale} shared), {generated} generated "
          f"tokens, {name}, {where}", flush=True)
    results: dict = {"requests": n, "generated_tokens": generated, "device": where, "model": name, "systems": []}

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))

    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        model_dir = build_model(Path(args.model_dir or tmp) / "llama8b", shape)
        print(f"  model built in {time.perf_counter() - started:.1f} s", flush=True)
        tokens = {}
        for mode in ("static", "continuous"):
            llm = LLMEngine(EngineConfig(model=str(model_dir), device=DEVICE, dtype=DTYPE, max_num_seqs=256,
                                         scheduling=mode))
            warm = [[(t * 7 + 1) % (shape["vocab_size"] - 3) + 3 for t in p] for p in prompts[:32]]
            llm.generate(warm, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))  # untimed
            passes = record_passes(llm.runner)
            params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in outputs]
            sync()
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            sync()
            seconds = time.perf_counter() - start
            tokens[mode] = [o.token_ids for o in outs]
            limit = limit_seconds(passes, shape, 2 if DTYPE == "bfloat16" else 4)
            entry = {"name": f"engine {mode}", "seconds": round(seconds, 3), "tok_s": generated / seconds,
                     "limit_tok_s": generated / limit["seconds"], "of_limit": limit["seconds"] / seconds,
                     "limit": limit, "kv_tokens": llm.pool_tokens,
                     "peak_rows": max(b.peak_rows for b in llm.batch_stats),
                     "preemptions": sum(b.preemptions for b in llm.batch_stats),
                     "graph_captures": llm.runner.graphs.captures if llm.runner.graphs else 0,
                     "graphs_failed": bool(llm.runner.graphs and llm.runner.graphs.failed)}
            results["systems"].append(entry)
            save()
            print(f"  engine {mode}: {seconds:.2f} s, {entry['tok_s']:,.0f} generated tok/s; limit "
                  f"{entry['limit_tok_s']:,.0f} tok/s ({limit['decode_s']:.2f} s decode + {limit['prefill_s']:.2f} s "
                  f"prefill over {limit['passes']} passes): {entry['of_limit']:.0%} of it; pool {entry['kv_tokens']} "
                  f"tokens, peak rows {entry['peak_rows']}, preemptions {entry['preemptions']}", flush=True)
            del llm, outs
            gc.collect()
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
        print(f"  static and continuous give the same tokens: {agreement(tokens['static'], tokens['continuous'])}")
        subset = sorted(range(n), key=lambda i: len(prompts[i]))[:: max(1, n // args.subset)][: args.subset]
        sub_prompts, sub_outputs = [prompts[i] for i in subset], [outputs[i] for i in subset]
        sub_generated = sum(sub_outputs)
        runs = [("transformers generate, padded batch", lambda: run_transformers(
            model_dir, sub_prompts, sub_outputs, batch_size=len(subset)))]
        if not args.skip_generate_batch:
            runs.append(("transformers generate_batch (continuous batching)",
                         lambda: run_transformers_batch(model_dir, sub_prompts, sub_outputs)))
        for label, fn in runs:
            try:
                seconds, toks = fn()
            except Exception as exc:  # noqa: BLE001  a baseline that cannot run is reported, not fatal
                print(f"  {label}: failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
                continue
            same = agreement(toks, [tokens["static"][i] for i in subset])
            results["systems"].append({"name": f"{label}, {len(subset)} requests", "seconds": round(seconds, 3),
                                       "tok_s": sub_generated / seconds, "same_tokens_as_engine": same})
            save()
            print(f"  {label} ({len(subset)} requests, {sub_generated} tokens): {seconds:.2f} s, "
                  f"{sub_generated / seconds:,.0f} generated tok/s, same tokens as the engine {same}", flush=True)
    print("\n| system | seconds | generated tok/s | of the limit |")
    print("|---|---:|---:|---:|")
    for e in results["systems"]:
        print(f"| {e['name']} | {e['seconds']:.2f} | {e['tok_s']:,.0f} | "
              f"{format(e['of_limit'], '.0%') if 'of_limit' in e else '-'} |")


def main() -> None:
    global DEVICE, DTYPE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="128 requests (a smoke run)")
    ap.add_argument("--smoke", action="store_true", help="check the script itself on CPU: tiny model, 16 requests")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--skip-eager", action="store_true", help="leave out the enforce_eager row")
    ap.add_argument("--json", help="write the results here (rewritten after each system)")
    ap.add_argument("--model-dir", help="where the random model is built (default: a temporary folder)")
    ap.add_argument("--workload", choices=("1.2b", "8b"), default="1.2b")
    ap.add_argument("--subset", type=int, default=32, help="8b: requests the transformers baselines run")
    ap.add_argument("--skip-generate-batch", action="store_true", help="8b: leave out transformers' generate_batch")
    ap.add_argument("--quantization", help="1.2b: bf16 against these methods (comma-separated) instead of the "
                                           "usual systems")
    args = ap.parse_args()
    if args.workload == "8b":
        if args.smoke:
            DEVICE, DTYPE = "cpu", "float32"
        return main_8b(args)
    shape, n = (SMOKE_SHAPE, 16) if args.smoke else (SHAPE, 128 if args.quick else 512)
    if args.smoke:
        DEVICE, DTYPE = "cpu", "float32"
    if args.quantization:
        return main_quantized(args, shape, n)
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
            last = phases[-1]
            how = "CUDA graphs" if last["graphs"] else "eager: graph capture failed" if last["graphs_failed"] else "eager"
            report(f"engine {mode} ({how})", t, toks)
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
