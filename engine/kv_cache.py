"""A slot-addressed KV cache plugged into transformers' Cache interface.

Each running sequence owns one row ("slot") of a (rows, heads, width, head_dim) buffer per
layer and fills it left to right from column 0, so a token's column is its position. Two kinds
of forward pass write into it:

- prefill: new sequences' prompts, right-padded, written into a block of free rows (or, for
  choice scoring, continuations written after a shared prompt);
- decode: one token per running row, each written at that row's own length.

Attention sees a view of the filled columns, and the attention mask hides each row's columns
beyond its own length. Buffers start zeroed: masked columns must hold finite values, since
attention multiplies them by a zero weight (uninitialized memory can hold NaN).
transformers' DynamicCache instead concatenates every step (a full copy
of the cache per token) and cannot give rows different lengths.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class SlotLayer(CacheLayerMixin):
    """One layer's keys and values. What a forward writes where is set by the owning KVCache."""

    is_sliding = False
    is_compileable = False

    def __init__(self, owner: "KVCache"):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, h, _, dk = key_states.shape
        self.device = key_states.device
        self.keys = key_states.new_zeros((self.owner.rows, h, self.owner.width, dk))
        self.values = value_states.new_zeros((self.owner.rows, h, self.owner.width, value_states.shape[-1]))
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        o = self.owner
        if o.positions is None:  # prefill rows [start, start + B), columns [past, past + S)
            rows = slice(o.start, o.start + key_states.shape[0])
            end = o.past + key_states.shape[-2]
            self.keys[rows, :, o.past:end] = key_states
            self.values[rows, :, o.past:end] = value_states
            return self.keys[rows, :, :end], self.values[rows, :, :end]
        n = key_states.shape[0]  # decode: rows [0, n), one column each
        rows = torch.arange(n, device=key_states.device)
        self.keys[rows, :, o.positions] = key_states[:, :, 0]
        self.values[rows, :, o.positions] = value_states[:, :, 0]
        return self.keys[:n, :, : o.past + 1], self.values[:n, :, : o.past + 1]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.past + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.past

    def get_max_length(self) -> int:
        return self.owner.width

    def reset(self) -> None:
        pass


class KVCache(Cache):
    """`rows` slots of `width` token columns for every decoder layer.

    Before each forward the batch says what it is: `prefill(start)` (new rows from `start`) or
    `decode(positions)` (rows [0, n), row i writing column positions[i]).
    """

    def __init__(self, num_layers: int, rows: int, width: int):
        self.rows = rows
        self.width = width
        self.start = 0
        self.positions: torch.Tensor | None = None
        self.past = 0  # columns before the first query token, as transformers' mask code sees it
        super().__init__(layers=[SlotLayer(self) for _ in range(num_layers)])

    def prefill(self, start: int, offset: int = 0) -> None:
        """Rows from `start` write their tokens from column `offset` on (attending to columns before it)."""
        self.start, self.positions, self.past = start, None, offset

    def decode(self, positions: torch.Tensor, width: int) -> None:
        """Row i writes column positions[i]; attention spans columns [0, width)."""
        self.positions, self.past = positions, width - 1

    @torch.inference_mode()  # the buffers were made inside the model's forward (inference mode)
    def move_rows(self, src: list[int], dst: list[int]) -> None:
        """Copies slots src[k] -> dst[k] (used to keep live rows contiguous from row 0)."""
        if not src:
            return
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys[dst] = layer.keys[src]
                layer.values[dst] = layer.values[src]

    @torch.inference_mode()
    def expand_rows(self, index: torch.Tensor) -> None:
        """New rows: row r is a copy of old row index[r] (one prompt shared by several continuations)."""
        self.rows = len(index)
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys = layer.keys.index_select(0, index)
                layer.values = layer.values.index_select(0, index)

    @torch.inference_mode()
    def resize(self, rows: int, width: int, keep_rows: int, keep_width: int) -> None:
        """New buffers of rows x width; the first keep_rows rows' first keep_width columns are kept."""
        self.rows, self.width = rows, width
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            for name in ("keys", "values"):
                old = getattr(layer, name)
                new = old.new_zeros((rows, old.shape[1], width, old.shape[3]))
                new[:keep_rows, :, :keep_width] = old[:keep_rows, :, :keep_width]
                setattr(layer, name, new)

    @property
    def tokens(self) -> int:
        """Token slots reserved: rows x width."""
        return self.rows * self.width

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers if layer.is_initialized
                   for t in (layer.keys, layer.values))
