"""Decode passes replayed from CUDA graphs: one kernel launch sequence per step instead of
hundreds of Python-issued launches.

A graph is captured per row bucket (1, 2, 4, 8, 16, 24, ... slots) for the KV pool's current
layout, on first use, into one shared memory pool. A decode of n rows copies its tokens and
lengths into static input buffers, pads them to the bucket (padding rows write column 0 of free
slots, which nothing reads) and replays. The graphs attend over the layout's full width (the
mask hides what each row has not filled), so shapes never change while the layout holds; a
new layout drops the graphs. If a capture fails, decoding goes on eagerly after one warning.
"""
from __future__ import annotations

import logging

import torch

from engine.kv_cache import KVCache

log = logging.getLogger(__name__)


def bucket_sizes(limit: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to `limit` (and `limit` itself)."""
    sizes = [b for b in (1, 2, 4) if b < limit] + list(range(8, limit, 8))
    return sizes + [limit]


class CudaGraphs:
    """Captured decode forwards of one ModelRunner, keyed by row bucket."""

    def __init__(self, runner):
        self.runner = runner
        self.layout: tuple[int, int] | None = None
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.failed = False
        self.tokens: torch.Tensor | None = None  # (slots,) static input buffers
        self.lengths: torch.Tensor | None = None
        self.buckets: list[int] = []

    def decode(self, cache: KVCache, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor | None:
        """Logits (n, V) of one decode step from a replayed graph, or None to run it eagerly."""
        if self.failed:
            return None
        if (cache.rows, cache.width) != self.layout:
            self._reset(cache)
        n = tokens.shape[0]
        b = next(size for size in self.buckets if size >= n)
        self.tokens[:n] = tokens
        self.lengths[:n] = lengths
        self.lengths[n:b] = 0
        entry = self.graphs.get(b)
        if entry is None:
            entry = self._capture(b, cache)
            if entry is None:
                return None
        entry[0].replay()
        return entry[1][:n]

    def _reset(self, cache: KVCache) -> None:
        self.graphs.clear()
        self.layout = (cache.rows, cache.width)
        device = self.runner.device
        self.tokens = torch.zeros(cache.rows, dtype=torch.int64, device=device)
        self.lengths = torch.zeros(cache.rows, dtype=torch.int64, device=device)
        self.buckets = bucket_sizes(cache.rows)

    def _run(self, b: int, cache: KVCache) -> torch.Tensor:
        runner, lengths, width = self.runner, self.lengths[:b], cache.width
        cache.decode(lengths, width)
        return runner.forward(self.tokens[:b, None], runner.decode_bias(lengths, width), lengths[:, None], cache)

    def _capture(self, b: int, cache: KVCache):
        try:
            # Warm up on a side stream first (lazy initialisation, library workspaces). It writes
            # the same keys and values the replay will.
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._run(b, cache)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph, pool=self.pool):
                out = self._run(b, cache)
        except Exception as exc:  # noqa: BLE001  any capture failure: run eagerly instead
            log.warning("CUDA graph capture failed (%s: %s); decoding eagerly (set enforce_eager=True to "
                        "skip capture)", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            self.failed = True
            self.graphs.clear()
            return None
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[b] = (graph, out)
        return self.graphs[b]
