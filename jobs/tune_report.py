"""What `batchinfer tune` prints and draws: a table per setting, the recommendation, a PNG."""
from __future__ import annotations

import statistics

from jobs.tune import SCHEDULING, Measurement


def table(results: list[Measurement], best: Measurement | None) -> str:
    """One line per setting; the recommended one starts with `*`."""
    head = ("max_batch_tokens", "max_num_seqs", "scheduling", "s", "gen tok/s", "total tok/s",
            "TTFT mean/p90 (s)", "peak KV MiB", "peak mem MiB", "errors")
    lines = [head]
    for r in results:
        ttft = f"{statistics.fmean(r.ttft):.2f}/{_p90(r.ttft):.2f}" if r.ttft else "-"
        kv = f"{r.peak_kv_bytes / 2**20:.1f}" if r.peak_kv_bytes else "-"
        s = r.setting
        lines.append((str(s.max_batch_tokens), str(s.max_num_seqs), s.scheduling, f"{r.seconds:.1f}",
                      f"{r.generated_per_s:.1f}", f"{r.total_per_s:.1f}", ttft, kv,
                      f"{r.peak_memory_bytes / 2**20:.0f}", str(r.errors)))
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    marks = ["  "] + ["* " if r is best else "  " for r in results]
    return "\n".join(mark + "  ".join(c.rjust(w) if i > 2 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     for mark, row in zip(marks, lines))


def pools(results: list[Measurement]) -> str:
    """The engine's memory: each setting's KV pool, and the weights (with their quantization)."""
    lines = []
    for r in results:
        m = r.memory
        if m:
            lines.append(f"  {r.setting.flags()}: KV pool {m['kv_blocks']} blocks x {m['block_size']} tokens = "
                         f"{m['kv_bytes'] / 2**20:.1f} MiB")
    weights = next((r.memory for r in results if r.memory), None)
    if weights:
        q, held = weights.get("quantization"), weights["weights_bytes"]
        dense = weights.get("unquantized_weights_bytes", held)
        if q:
            lines.append(f"  weights: {held / 2**20:.1f} MiB with quantization {q}, {dense / 2**20:.1f} MiB without: "
                         f"it saves {(dense - held) / 2**20:.1f} MiB ({held / dense:.2f}x)")
        else:
            lines.append(f"  weights: {held / 2**20:.1f} MiB (no quantization; --set engine.quantization=int8 "
                         "would hold about a quarter of the linear layers' bytes)")
        if weights.get("load_peak_bytes"):
            lines.append(f"  loading them added {weights['load_peak_bytes'] / 2**20:.1f} MiB at its peak"
                         + (" (each layer quantized as it was read)" if q and weights.get("streamed") else ""))
    return "\n".join(lines)


def summary(results: list[Measurement], best: Measurement | None, memory_limit: int | None) -> str:
    """The recommendation in one line, as the flags that set it."""
    limit = f" under {memory_limit / 2**20:.0f} MiB" if memory_limit is not None else ""
    if best is None:
        smallest = min(results, key=lambda r: r.peak_memory_bytes)
        return (f"no setting fits{limit}: the smallest peak was {smallest.peak_memory_bytes / 2**20:.0f} MiB "
                f"({smallest.setting.flags()})")
    rate = f"{best.generated_per_s:.1f} generated tok/s" if best.generated_tokens else f"{best.total_per_s:.1f} tok/s"
    return (f"recommended{limit}: {best.setting.flags()} ({rate}, peak memory "
            f"{best.peak_memory_bytes / 2**20:.0f} MiB)")


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def plot(results: list[Measurement], best: Measurement | None, memory_limit: int | None, path: str) -> None:
    """Throughput against peak memory, one marker per scheduling mode, each point labelled."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install -e '.[bench]' (or pip install matplotlib)") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, marker in zip(SCHEDULING, "os"):
        pts = [r for r in results if r.setting.scheduling == mode]
        ax.scatter([r.peak_memory_bytes / 2**20 for r in pts], [r.rate for r in pts],
                   marker=marker, label=mode)
        for r in pts:
            ax.annotate(f"{r.setting.max_batch_tokens}/{r.setting.max_num_seqs}",
                        (r.peak_memory_bytes / 2**20, r.rate), fontsize=7)
    if best is not None:
        ax.scatter([best.peak_memory_bytes / 2**20], [best.rate], s=200,
                   facecolors="none", edgecolors="red", label="recommended")
    if memory_limit is not None:
        ax.axvline(memory_limit / 2**20, color="grey", linestyle="--", label="memory limit")
    ax.set_xlabel("peak memory (MiB)")
    ax.set_ylabel("generated tokens/s" if any(r.generated_tokens for r in results) else "tokens/s")
    ax.set_title("batchinfer tune: labels are max_batch_tokens/max_num_seqs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
