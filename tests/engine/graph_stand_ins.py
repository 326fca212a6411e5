"""Stand-ins for torch.cuda's graph calls, so decode graphs' capture and replay logic runs on a CPU:
a captured pass is recorded, and a replay runs it. Used by test_cuda_graph and test_fast_paths."""
from __future__ import annotations

import contextlib

import torch

from engine.runner.cuda_graph import DecodeGraphs


def stand_in_cuda_graphs(monkeypatch, replay_offset: float = 0.0, capture_raises: bool = False) -> dict:
    """Installs the stand-ins (undone by monkeypatch). A replay's logits are off by `replay_offset`;
    `capture_raises` makes every capture fail. Returns the state: `warm` (buckets run outside a
    capture) and `cold_in_capture` (buckets captured before they ever ran outside one)."""
    state = {"graph": None, "warm": set(), "cold_in_capture": []}

    class Graph:
        def replay(self):
            self.forward()
            if replay_offset:
                self.buffers["logits"].add_(replay_offset)

        def pool(self):
            return "pool"

    @contextlib.contextmanager
    def capturing(graph, pool=None):
        if capture_raises:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        state["graph"] = graph
        try:
            yield
        finally:
            state["graph"] = None

    class Stream:
        def wait_stream(self, other):
            pass

    forward = DecodeGraphs._forward

    def spy(self, b, cache):
        graph = state["graph"]
        if graph is not None:
            if b not in state["warm"]:
                state["cold_in_capture"].append(b)
            graph.forward, graph.buffers = (lambda: forward(self, b, cache)), self._buffers
            return
        state["warm"].add(b)
        forward(self, b, cache)

    monkeypatch.setattr(DecodeGraphs, "_forward", spy)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", capturing)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    return state
