"""Decode passes replayed from CUDA graphs over the paged pool: one launch sequence per step
instead of hundreds of Python-issued kernel launches.

A decode pass (every row computes one token and samples it) of n rows runs in the graph of the
smallest row bucket b >= n (`bucket_sizes`), captured on first use into one shared memory pool
and kept. All graphs read from the same static buffers: input tokens, positions, KV slots, block
tables (as wide as the longest row `max_model_len` allows) and each row's length, and write
their logits into one static output. A step copies its rows into the buffers and pads rows n..b
with a row of length 1 whose keys and values go to the pool's spare block
(`PagedKVCache.scratch_block`), which no row owns, so padding never touches a live block. Block
tables and lengths are graph inputs: the attention kernels read each row only to its own length,
so a graph serves every step of its bucket whatever the rows' lengths, and the split-KV decode
attention is captured with the segment count of the longest row `max_model_len` allows (a short
row's extra segments are empty and cost a program each).

Passes with prefill chunks, LongRoPE models (their rotary factors follow each row's length) and
tensor-parallel engines run eagerly. So does everything after a capture fails: one warning,
then eager decoding. `enforce_eager` (vLLM's name) skips graphs altogether.

`capture=False` runs the same padded, static-buffer pass eagerly: how the CPU tests check the
buffers, the padding and the spare block without a GPU.
"""
from __future__ import annotations

import logging
import time

import torch

from engine.api.errors import one_line
from engine.runner.attention import PassMetadata

log = logging.getLogger(__name__)


def bucket_sizes(limit: int) -> list[int]:
    """Row buckets up to `limit` (which is always one): 1, 2, 4, 8, 16, 24, 32, then steps of 16
    up to 128 and of 32 beyond (padding stays under ~1/8 of the rows above 16)."""
    sizes = [1, 2, 4, 8, 16, 24, 32, *range(48, 129, 16), *range(160, limit, 32)]
    return [b for b in sizes if b < limit] + [limit]


def graphs_supported(runner) -> bool:
    """Whether decode graphs can serve a ModelRunner: CUDA, one rank, no row-wise LongRoPE, and
    no dynamic rotary scaling (transformers compares the pass's largest position with
    a tensor on the host each forward, which no capture allows)."""
    dynamic = any("dynamic" in str(getattr(m, "rope_type", "")) for m in runner.model.modules())
    return (runner.device.type == "cuda" and runner.tensor_parallel_size == 1 and runner.longrope is None
            and not dynamic)


class DecodeGraphs:
    """Captured decode forwards of one ModelRunner over one KV pool, keyed by row bucket."""

    def __init__(self, runner, max_rows: int, max_blocks: int, capture: bool = True):
        self.runner = runner
        self.max_rows = max_rows
        """Most rows a decode pass has (max_num_seqs): the static buffers' rows."""
        self.max_blocks = max_blocks
        """Most blocks a row holds (max_model_len's): the block tables' width."""
        self.capture = capture
        self.buckets = bucket_sizes(max_rows)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.cache = None
        """The pool the graphs were captured over (they hold its buffers' addresses)."""
        self.pool = None
        self.failed = False
        self.paths = getattr(runner, "paths", None)
        """The engine's fast paths (engine.runner.fast_paths): `cuda_graphs` is recorded there."""
        self.checked = False
        """Whether a replay was checked against eager decoding (once, at the first capture)."""
        self.warmed: set[int] = set()
        """Buckets whose pass has run once outside a capture (see _capture)."""
        self.captures = 0
        """Graphs captured so far."""
        self.capture_seconds = 0.0
        """Host time spent capturing (and in each bucket's warm-up pass)."""
        self.replays = 0
        """Decode passes run from the static buffers (replayed, or eagerly with capture=False)."""
        self._buffers: dict[str, torch.Tensor] | None = None

    def eligible(self, inputs) -> bool:
        """Whether `inputs` (a PassInputs) is a decode pass a graph can run: one token per row, every
        row sampling, no LongRoPE factors or M-RoPE positions, within the buffers."""
        n = len(inputs.tokens)
        return (not self.failed and not inputs.spans and inputs.small is None and inputs.long_tokens is None
                and inputs.images is None and inputs.rope is None
                and inputs.keep is not None and len(inputs.keep) == n == inputs.tables.shape[0]
                and 0 < n <= self.max_rows and inputs.keep[-1] == n - 1
                and inputs.tables.shape[1] <= self.max_blocks)

    def run(self, cache, inputs) -> torch.Tensor | None:
        """Logits (n, V) float32 of the decode pass `inputs`, or None to run it eagerly. The
        logits are a view of the static output: read them before the next pass."""
        if not cache.allocated:
            return None
        if cache is not self.cache:
            self._reset(cache)
        n = len(inputs.tokens)
        b = next(size for size in self.buckets if size >= n)
        self._fill(inputs, n, b, cache)
        if not self.capture:
            self._forward(b, cache)
        else:
            graph = self.graphs.get(b) or self._capture(b, cache)
            if graph is None:
                return None
            graph.replay()
        self.replays += 1
        return self._buffers["logits"][:n]

    def _reset(self, cache) -> None:
        """A new pool (the graphs point into the old one's buffers): capture again."""
        self.graphs.clear()
        self.pool = None
        self.warmed = set()
        self.cache = cache

    def _allocate(self) -> dict[str, torch.Tensor]:
        dev, rows = self.runner.device, self.max_rows
        return {"ids": torch.zeros((1, rows), dtype=torch.int64, device=dev),
                "positions": torch.zeros((1, rows), dtype=torch.int64, device=dev),
                "slots": torch.zeros(rows, dtype=torch.int64, device=dev),
                "tables": torch.zeros((rows, self.max_blocks), dtype=torch.int32, device=dev),
                "rows": torch.arange(rows, dtype=torch.int32, device=dev),
                "ctx": torch.ones(rows, dtype=torch.int32, device=dev),
                "logits": torch.zeros((rows, self.runner.vocab_size), dtype=torch.float32, device=dev)}

    def _fill(self, inputs, n: int, b: int, cache) -> None:
        """Copies the pass's rows into the static inputs and pads rows n..b onto the spare block."""
        if self._buffers is None:
            self._buffers = self._allocate()
        buf = self._buffers
        buf["ids"][0, :n].copy_(torch.tensor(inputs.tokens, dtype=torch.int64), non_blocking=True)
        buf["positions"][0, :n].copy_(torch.from_numpy(inputs.positions), non_blocking=True)
        buf["slots"][:n].copy_(torch.from_numpy(inputs.slots), non_blocking=True)
        buf["ctx"][:n].copy_(torch.from_numpy(inputs.ctx), non_blocking=True)
        buf["tables"][:n, : inputs.tables.shape[1]].copy_(torch.from_numpy(inputs.tables), non_blocking=True)
        if b > n:
            scratch = cache.scratch_block
            buf["ids"][0, n:b] = 0
            buf["positions"][0, n:b] = 0
            buf["slots"][n:b] = scratch * cache.block_size
            buf["ctx"][n:b] = 1
            buf["tables"][n:b, 0] = scratch

    def _metadata(self, b: int, cache) -> PassMetadata:
        buf = self._buffers
        return PassMetadata(slot_mapping=buf["slots"][:b], block_tables=buf["tables"][:b], token_row=buf["rows"][:b],
                            ctx=buf["ctx"][:b], max_ctx=self.max_blocks * cache.block_size, small=None, chunks=[])

    def _forward(self, b: int, cache) -> None:
        buf = self._buffers
        logits = self.runner.model_logits(cache, self._metadata(b, cache), buf["ids"][:, :b],
                                          buf["positions"][:, :b])
        buf["logits"][:b].copy_(logits)

    def _capture(self, b: int, cache) -> "torch.cuda.CUDAGraph | None":
        started = time.perf_counter()
        try:
            graph = self._capture_pass(b, cache)
            why = None if self.checked else self._check_replay(graph, b, cache)
        except Exception as exc:  # noqa: BLE001  any capture failure: decode eagerly instead
            why = one_line(exc)
        if why is not None:
            self.failed = True
            self.graphs.clear()
            self.pool = None  # a pool whose graphs are all gone is freed: never capture into it again
            fallback = "eager decoding (enforce_eager=True skips capture)"
            if self.paths is not None:
                self.paths.fall_back("cuda_graphs", why, fallback)  # raises under strict_kernels
            else:
                log.warning("CUDA graph capture failed (%s); %s", why, fallback)
            return None
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[b] = graph
        self.captures += 1
        self.capture_seconds += time.perf_counter() - started
        return graph

    def _capture_pass(self, b: int, cache) -> "torch.cuda.CUDAGraph":
        """Bucket b's decode pass captured into a graph (its inputs already in the buffers)."""
        if b not in self.warmed:
            # Each bucket once, on a side stream, before its capture: loading a kernel (a
            # Triton variant is chosen by the bucket's rows: split-KV or not, its segment
            # count), lazy initialisation and library workspaces are not allowed inside a
            # capture. It writes the keys and values the replay will write.
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(b, cache)
            torch.cuda.current_stream().wait_stream(stream)
            self.warmed.add(b)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self.pool):
            self._forward(b, cache)
        return graph

    def _check_replay(self, graph, b: int, cache) -> str | None:
        """The first graph captured, replayed once against the same pass run eagerly (both write the
        same keys and values to the same slots, so running both changes nothing): why it failed
        when its logits differ beyond the model dtype's tolerance, else None."""
        from engine.runner.fast_paths import relative_difference

        graph.replay()
        replayed = self._buffers["logits"][:b].clone()
        self._forward(b, cache)
        diff = relative_difference(replayed, self._buffers["logits"][:b])
        tolerance = 1e-3 if self.runner.dtype == torch.float32 else 3e-2
        self.checked = True
        if self.paths is not None:
            self.paths.state["cuda_graphs"] = "checked"
        if diff <= tolerance:
            return None
        return f"a replay's logits differ from eager decoding's by {diff:.3g} of their largest (tolerance {tolerance:g})"
