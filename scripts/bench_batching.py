#!/usr/bin/env python
"""The batching table: one request at a time vs static batches vs continuous batching.

On one model and one machine, in one run, for three offline workloads (every request arrives
at t=0):
  a) uniform:      prompts 128, outputs 128 tokens
  b) mixed output: prompts 16-256, outputs 16-512 tokens (different max_tokens per request:
                   the stand-in for early EOS stops)
  c) labeling:     prompts 512-1024, outputs 1-16 tokens
it measures the engine one request at a time (max_num_seqs=1), with static batches and with
continuous batching at the same max_batch_tokens, plus transformers' generate (batch 1 and
padded batches holding the same KV memory) and CTranslate2 (float32) when it is installed
(`pip install -e .[bench]`), token-batched (its budget counts prompt tokens only, so it runs
more rows at once than the engine's KV budget allows) and in batches of the same rows as the
transformers padded batches. Greedy, ignore_eos: every request generates exactly its
max_tokens, so every mode does the same work, and the engine's outputs are checked to agree.

Each measurement runs in a fresh subprocess (so peak memory is its own). Columns: generated
tokens/s, total (prompt + generated) tokens/s, ratio to the engine one-at-a-time, mean and p99
time to first token (TTFT) and time per output token after the first (TPOT), wasted-token
fraction (prompt padding computed / prompt + generated tokens computed), peak memory (RSS, or
CUDA max allocated), and, for the engine, the peak KV cache in use and the prefix-cache hit
rate (prompt tokens served from cached blocks).

    .venv/bin/python scripts/bench_batching.py [--quick] [--out results/bench_batching]
        [--model builtin:llama-42m] [--device cpu] [--dtype float32] [--threads 2]
        [--workloads a,b,c] [--skip hf,ct2]

Writes OUT/table.md, OUT/results.json and OUT/tokens_per_s.png.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# name -> (description, requests, prompt range, output range, max_batch_tokens); --quick scales down
WORKLOADS = {
    "a": ("uniform: prompts 128, outputs 128", 32, (128, 128), (128, 128), 4096),
    "b": ("mixed output: prompts 16-256, outputs 16-512", 32, (16, 256), (16, 512), 8192),
    "c": ("labeling: prompts 512-1024, outputs 1-16", 48, (512, 1024), (1, 16), 8192),
}
QUICK = {
    "a": (8, (64, 64), (32, 32), 1024),
    "b": (10, (16, 128), (8, 128), 2048),
    "c": (12, (256, 512), (1, 8), 4096),
}
MODES = {
    "engine-1": "engine, one request at a time",
    "engine-static": "engine, static batches",
    "engine-continuous": "engine, continuous batching",
    "hf-1": "transformers generate, batch 1",
    "hf-padded": "transformers generate, padded batches",
    "ct2": "CTranslate2 float32, token-batched",
    "ct2-rows": "CTranslate2 float32, padded-batch rows",
}
BASELINE = "engine-1"


def workload(key: str, quick: bool, vocab: int, seed: int = 0):
    desc, n, prompt_range, output_range, budget = WORKLOADS[key]
    if quick:
        n, prompt_range, output_range, budget = QUICK[key]
    rng = random.Random(f"{seed}-{key}")
    prompts = [[rng.randrange(3, min(vocab, 32000)) for _ in range(rng.randint(*prompt_range))] for _ in range(n)]
    outputs = [rng.randint(*output_range) for _ in range(n)]
    return prompts, outputs, budget


# -- one measurement (runs in its own process) ----------------------------------------------------

def measure(mode: str, key: str, args) -> dict:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from engine.api import EngineConfig
    from engine.models import builtin_path

    model_dir = builtin_path(args.model) if args.model.startswith("builtin:") else args.model
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    prompts, outputs, budget = workload(key, args.quick, cfg["vocab_size"])
    rows = max(1, budget // (max(map(len, prompts)) + max(outputs)))  # rows a padded batch may hold
    result = {"mode": mode, "workload": key, "requests": len(prompts), "prompt_tokens": sum(map(len, prompts)),
              "generated_tokens": sum(outputs), "max_batch_tokens": budget, "padded_batch_rows": rows}
    if mode.startswith("engine"):
        from engine import LLMEngine, SamplingParams

        scheduling = "continuous" if mode == "engine-continuous" else "static"
        llm = LLMEngine(EngineConfig(model=args.model, max_batch_tokens=budget, dtype=args.dtype, device=args.device,
                                     max_num_seqs=1 if mode == "engine-1" else 256, scheduling=scheduling))
        llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2))  # warm-up: first-call allocations
        llm.batch_stats.clear()
        _sync(args.device)
        _reset_peak(args.device)
        start = time.perf_counter()
        seqs = [llm.add_request(p, SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))
                for p, m in zip(prompts, outputs)]
        peak_blocks = 0
        while llm.has_unfinished():
            llm.step()
            peak_blocks = max(peak_blocks, llm.pool.num_used)  # the pool's blocks rows hold (or cache) now
        peak_kv = peak_blocks * llm.memory["kv_bytes"] // llm.pool.num_blocks
        _sync(args.device)
        seconds = time.perf_counter() - start
        assert all(s.num_output_tokens == m for s, m in zip(seqs, outputs)), "a request stopped early"
        stats = llm.batch_stats
        padded = sum(s.padded_prompt_tokens for s in stats)
        computed = padded + sum(s.computed_rows for s in stats)
        ttft = [s.first_token_time - start for s in seqs]
        tpot = [(s.finish_time - s.first_token_time) / (s.num_output_tokens - 1) for s in seqs
                if s.num_output_tokens > 1]
        result.update(seconds=seconds, ttft=ttft, tpot=tpot, wasted=(padded - result["prompt_tokens"]) / computed,
                      peak_kv_bytes=peak_kv, batches=len(stats), peak_rows=max(s.peak_rows for s in stats),
                      forward_passes=sum(s.prefill_steps + s.decode_steps for s in stats),
                      prefix_hit_rate=sum(s.cached_prompt_tokens for s in stats) / result["prompt_tokens"],
                      tokens=[s.output_token_ids for s in seqs])
    elif mode.startswith("hf"):
        from transformers import AutoModelForCausalLM

        from engine.runner import resolve_device, resolve_dtype

        device = resolve_device(args.device)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=resolve_dtype(args.dtype, device),
                                                     attn_implementation="sdpa").to(device).eval()
        size = 1 if mode == "hf-1" else rows
        _reset_peak(args.device)
        start = time.perf_counter()
        tokens, computed = _hf_generate(model, prompts, outputs, size, device)
        _sync(args.device)
        seconds = time.perf_counter() - start
        useful = result["prompt_tokens"] + sum(outputs) - len(outputs)
        result.update(seconds=seconds, wasted=1 - useful / computed, tokens=tokens, batch_size=size)
    elif mode.startswith("ct2"):
        import importlib.util

        spec = importlib.util.spec_from_file_location("ct2_reference", ROOT / "scripts" / "ct2_reference.py")
        ct2 = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ct2)
        if ct2.available() is not None:
            return {**result, "skipped": f"ctranslate2 not available ({ct2.available()})"}
        out_dir = ct2.convert(model_dir, Path(os.environ.get("BATCHINFER_CACHE", Path.home() / ".cache/batchinfer"))
                              / "ct2" / f"{Path(model_dir).name}-float32")
        run = ct2.generate(out_dir, prompts, outputs, threads=args.threads or torch.get_num_threads(),
                           max_batch_tokens=budget, batch_rows=rows if mode == "ct2-rows" else None)
        result.update(seconds=run["seconds"], tokens=run["outputs"])
    result["peak_memory_bytes"] = _peak_memory(args.device)
    return result


def _hf_generate(model, prompts, outputs, size: int, device):
    """Input-order batches of `size`, left-padded; returns (tokens, token positions computed)."""
    import torch

    tokens, computed = [], 0
    with torch.inference_mode():
        for start in range(0, len(prompts), size):
            chunk, lens = prompts[start:start + size], outputs[start:start + size]
            width, new = max(map(len, chunk)), max(lens)
            ids = torch.zeros((len(chunk), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(chunk):
                ids[i, width - len(p):] = torch.tensor(p)
                mask[i, width - len(p):] = 1
            g = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                               min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
            tokens += [g[i, width:width + m].tolist() for i, m in enumerate(lens)]
            computed += len(chunk) * (width + new - 1)
    return tokens, computed


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        torch.cuda.synchronize()


def _reset_peak(device: str) -> None:
    import torch

    if torch.cuda.is_available() and device != "cpu":
        torch.cuda.reset_peak_memory_stats()


def _peak_memory(device: str) -> int:
    import torch

    if torch.cuda.is_available() and device != "cpu":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


# -- the driver -----------------------------------------------------------------------------------

def run_all(args) -> list[dict]:
    results = []
    modes = [m for m in MODES if not any(m.startswith(s) for s in args.skip)]
    for key in args.workloads:
        for mode in modes:
            cmd = [sys.executable, __file__, "--measure", mode, key, *_passthrough(args)]
            print(f"[{key}] {MODES[mode]} ...", end=" ", flush=True)
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if proc.returncode != 0:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
                results.append({"mode": mode, "workload": key, "skipped": f"failed: {' '.join(tail)}"})
                print("failed:", *tail)
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            results.append(r)
            print(r.get("skipped") or f"{r['generated_tokens'] / r['seconds']:.1f} generated tok/s")
    return results


def _passthrough(args) -> list[str]:
    out = ["--model", args.model, "--device", args.device, "--dtype", args.dtype, "--threads", str(args.threads)]
    return out + (["--quick"] if args.quick else [])


def _pct(values, q):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def table(results: list[dict], header: str) -> str:
    lines = [header, "",
             "| workload | mode | s | gen tok/s | total tok/s | vs 1-at-a-time | TTFT mean / p99 (s) | "
             "TPOT mean / p99 (ms) | wasted | peak mem (MiB) | peak KV (MiB) | prefix hit | same tokens |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    by = {(r["workload"], r["mode"]): r for r in results}
    for key in dict.fromkeys(r["workload"] for r in results):
        base = by.get((key, BASELINE))
        for mode, name in MODES.items():
            r = by.get((key, mode))
            if r is None:
                continue
            if "skipped" in r:
                lines.append(f"| {key} | {name} | {r['skipped']} ||||||||||")
                continue
            gen = r["generated_tokens"] / r["seconds"]
            total = (r["generated_tokens"] + r["prompt_tokens"]) / r["seconds"]
            ratio = f"{base['seconds'] / r['seconds']:.2f}x" if base and "seconds" in base else "-"
            ttft = (f"{sum(r['ttft']) / len(r['ttft']):.2f} / {_pct(r['ttft'], 0.99):.2f}" if r.get("ttft") else "-")
            tpot = (f"{1000 * sum(r['tpot']) / len(r['tpot']):.0f} / {1000 * _pct(r['tpot'], 0.99):.0f}"
                    if r.get("tpot") else "-")
            wasted = f"{r['wasted']:.1%}" if "wasted" in r else "-"
            kv = f"{r['peak_kv_bytes'] / 2**20:.0f}" if "peak_kv_bytes" in r else "-"
            hit = f"{r['prefix_hit_rate']:.1%}" if "prefix_hit_rate" in r else "-"
            same = r.get("same_tokens") or "-"
            lines.append(f"| {key} | {name} | {r['seconds']:.1f} | {gen:.1f} | {total:.1f} | {ratio} | {ttft} | "
                         f"{tpot} | {wasted} | {r['peak_memory_bytes'] / 2**20:.0f} | {kv} | {hit} | {same} |")
    return "\n".join(lines)


def _agreement(r: dict, base: dict | None) -> str | None:
    """'k/n': requests whose tokens equal the engine's one-at-a-time tokens."""
    if not base or not base.get("tokens") or not r.get("tokens"):
        return None
    return f"{sum(a == b for a, b in zip(r['tokens'], base['tokens']))}/{len(base['tokens'])}"


def plot(results: list[dict], path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e .[bench]): no plot"
    keys = list(dict.fromkeys(r["workload"] for r in results))
    modes = [m for m in MODES if any(r["mode"] == m and "seconds" in r for r in results)]
    by = {(r["workload"], r["mode"]): r for r in results if "seconds" in r}
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / max(1, len(modes))
    for ax, (title, counted) in zip(axes, [("generated tokens / s", ("generated_tokens",)),
                                           ("total (prompt + generated) tokens / s",
                                            ("generated_tokens", "prompt_tokens"))]):
        for j, mode in enumerate(modes):
            xs = [i + j * width for i in range(len(keys))]
            ys = [sum(by[(k, mode)][c] for c in counted) / by[(k, mode)]["seconds"] if (k, mode) in by else 0
                  for k in keys]
            ax.bar(xs, ys, width, label=MODES[mode])
        ax.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(keys))])
        ax.set_xticklabels([f"{k}) {WORKLOADS[k][0].split(':')[0]}" for k in keys], fontsize=8)
        ax.set_ylabel(title)
    axes[1].legend(fontsize=7, loc="upper left")  # the low bars of a) and b) leave room there
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small workloads (a smoke run of a few minutes)")
    ap.add_argument("--out", default="results/bench_batching", help="folder for table.md, results.json, the plot")
    ap.add_argument("--model", default="builtin:llama-42m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=0, help="torch/CTranslate2 threads (0 = torch's default)")
    ap.add_argument("--workloads", default="a,b,c", type=lambda s: [w for w in s.split(",") if w])
    ap.add_argument("--skip", default="", type=lambda s: [w for w in s.split(",") if w],
                    help="mode prefixes to leave out, e.g. hf,ct2")
    ap.add_argument("--replot", action="store_true", help="redo table.md and the plot from OUT/results.json")
    ap.add_argument("--measure", nargs=2, metavar=("MODE", "WORKLOAD"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure, args)))
        return
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        ap.error(f"unknown workload(s) {unknown}; choose from {list(WORKLOADS)}")
    import torch

    threads = args.threads or torch.get_num_threads()
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        saved = json.loads((out / "results.json").read_text())
        header, results = saved["header"], saved["results"]
    else:
        results = run_all(args)
        header = (f"batching table, {time.strftime('%Y-%m-%d %H:%M')}: {args.model}, {args.dtype}, "
                  f"device {args.device}, {threads} threads{', --quick' if args.quick else ''}. Greedy, ignore_eos, "
                  "all requests at t=0. Workloads: " + "; ".join(f"{k}) {WORKLOADS[k][0]}" for k in args.workloads)
                  + ". 'same tokens' compares each request's tokens with the engine one-at-a-time.")
        base = {r["workload"]: r for r in results if r["mode"] == BASELINE}
        for r in results:  # agreement is computed now; the token lists themselves are not kept
            r["same_tokens"] = _agreement(r, base.get(r["workload"]))
        for r in results:
            r.pop("tokens", None)
        (out / "results.json").write_text(json.dumps({"header": header, "results": results}, indent=1))
    md = table(results, header)
    (out / "table.md").write_text(md + "\n")
    note = plot(results, out / "tokens_per_s.png")
    print()
    print(md)
    print(f"\nwrote {out / 'table.md'}, {out / 'results.json'}" + (f"; {note}" if note else f", {out / 'tokens_per_s.png'}"))


if __name__ == "__main__":
    main()
