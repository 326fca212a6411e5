"""Decode passes replayed from CUDA graphs: one kernel launch sequence per step instead of
hundreds of Python-issued launches.

A graph is captured per KV layout (slots x width) and row bucket (1, 2, 4, 8, 16, 24, 32, 48,
..., see `bucket_sizes`), on first use, into one shared memory pool, and kept: the pool's
buffers never move, so a graph stays valid whenever its layout comes back (next batch, after
choice scoring). All graphs read their inputs from the same static buffers and write their
logits into one static output buffer, so a kept graph holds no memory of its own beyond the
pool's. A decode of n rows copies its tokens and lengths into the input buffers, pads them to
the bucket (padding rows write column 0 of free slots, which nothing reads) and replays.
The graphs attend over the layout's full width (the mask hides what each row has not filled).

Capturing costs about two eager forward passes of host time, so the bucket list is short and
coarser for large batches (padding there costs a few percent; a capture costs many steps).
If a capture fails, decoding goes on eagerly after one warning.
"""
from __future__ import annotations

import logging
import time

import torch

from engine.kv_cache import KVCache

log = logging.getLogger(__name__)


def bucket_sizes(limit: int) -> list[int]:
    """Row buckets up to `limit` (which is always one): 1, 2, 4, 8, 16, 24, 32, then steps of 16
    up to 128 and of 32 beyond (padding stays under ~1/8 of the rows above 16)."""
    sizes = [1, 2, 4, 8, 16, 24, 32, *range(48, 129, 16), *range(160, limit, 32)]
    return [b for b in sizes if b < limit] + [limit]


class CudaGraphs:
    """Captured decode forwards of one ModelRunner, keyed by (slots, width, bucket)."""

    def __init__(self, runner, max_rows: int):
        self.runner = runner
        self.max_rows = max_rows
        """Most slots any decode layout has (max_num_seqs): the static buffers' size."""
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.failed = False
        self.warmed_up = False
        self.captures = 0
        """Graphs captured so far."""
        self.capture_seconds = 0.0
        """Host wall time spent capturing (and in the one warm-up pass)."""
        self.tokens: torch.Tensor | None = None  # (max_rows,) static inputs
        self.lengths: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None  # (max_rows, V) float32 static output

    def decode(self, cache: KVCache, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor | None:
        """Logits (n, V) of one decode step from a replayed graph, or None to run it eagerly."""
        if self.failed or cache.rows > self.max_rows:
            return None
        if self.tokens is None:
            device = self.runner.device
            self.tokens = torch.zeros(self.max_rows, dtype=torch.int64, device=device)
            self.lengths = torch.zeros(self.max_rows, dtype=torch.int64, device=device)
            self.logits = torch.zeros(self.max_rows, self.runner.vocab_size, dtype=torch.float32, device=device)
        n = tokens.shape[0]
        b = next(size for size in bucket_sizes(cache.rows) if size >= n)
        self.tokens[:n] = tokens
        self.lengths[:n] = lengths
        self.lengths[n:b] = 0
        graph = self.graphs.get((cache.rows, cache.width, b))
        if graph is None:
            graph = self._capture(b, cache)
            if graph is None:
                return None
        graph.replay()
        return self.logits[:n]

    def _run(self, b: int, cache: KVCache) -> None:
        runner, lengths, width = self.runner, self.lengths[:b], cache.width
        cache.decode(lengths, width)
        logits = runner.forward(self.tokens[:b, None], runner.decode_bias(lengths, width), lengths[:, None], cache)
        self.logits[:b].copy_(logits)

    def _capture(self, b: int, cache: KVCache) -> torch.cuda.CUDAGraph | None:
        started = time.perf_counter()
        try:
            if not self.warmed_up:
                # Once, on a side stream: lazy initialisation and library workspaces must not
                # happen inside a capture. It writes the keys and values a replay would.
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    self._run(b, cache)
                torch.cuda.current_stream().wait_stream(stream)
                self.warmed_up = True
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph, pool=self.pool):
                self._run(b, cache)
        except Exception as exc:  # noqa: BLE001  any capture failure: run eagerly instead
            log.warning("CUDA graph capture failed (%s: %s); decoding eagerly (set enforce_eager=True to "
                        "skip capture)", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            self.failed = True
            self.graphs.clear()
            self.pool = None  # a pool whose graphs are all gone is freed: never capture into it again
            return None
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[(cache.rows, cache.width, b)] = graph
        self.captures += 1
        self.capture_seconds += time.perf_counter() - started
        return graph
