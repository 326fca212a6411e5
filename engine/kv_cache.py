"""A KV cache allocated once per batch, plugged into transformers' Cache interface.

transformers' DynamicCache concatenates every step (a full copy of the cache per token);
this one writes each step into a buffer sized for the whole batch and hands attention a view
of the filled part. All rows share one write position: rows are left-padded, so the columns
line up, and the attention mask hides the padding.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class SlabLayer(CacheLayerMixin):
    """One layer's keys and values: (B, H, capacity, D) buffers, filled left to right."""

    is_sliding = False
    is_compileable = False

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, dk = key_states.shape
        self.device = key_states.device
        self.keys = key_states.new_empty((b, h, self.capacity, dk))
        self.values = value_states.new_empty((b, h, self.capacity, value_states.shape[-1]))
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: {end} > capacity {self.capacity}")
        self.keys[:, :, start:end] = key_states
        self.values[:, :, start:end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        self.length = 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keeps only rows `indices` (new, smaller buffers: the freed rows' memory goes back)."""
        if self.is_initialized:
            self.keys = self.keys.index_select(0, indices)
            self.values = self.values.index_select(0, indices)


class KVCache(Cache):
    """Per-batch cache: one SlabLayer per decoder layer, `capacity` token slots per row."""

    def __init__(self, num_layers: int, capacity: int):
        super().__init__(layers=[SlabLayer(capacity) for _ in range(num_layers)])
        self.capacity = capacity

    def select_rows(self, indices: torch.Tensor) -> None:
        for layer in self.layers:
            layer.batch_select_indices(indices)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers if layer.is_initialized
                   for t in (layer.keys, layer.values))
