"""The KV pool: one buffer per layer, allocated once, seen through a slot layout.

Each layer's keys and values live in a flat buffer of `capacity` token slots (sized from
max_batch_tokens), allocated on the first forward pass and never again. A batch sees it as
`rows` slots of `width` columns, a (rows, heads, width, head_dim) view: each running sequence
owns one slot and fills it left to right from column 0, so a token's column is its position.
The layout changes only between batches or when a wider row joins (then the live columns are
moved, in place); buffers, addresses and so CUDA graphs captured for a layout stay valid.

Two kinds of forward pass write into it:
- prefill: new rows' prompts, right-padded, into a block of free slots (or, for choice
  scoring, continuations written after a shared prompt);
- decode: one token per running row, each written at that row's own length.

Attention sees a view of the slots (no copy); the caller's 4-D attention mask hides each row's
columns beyond its own length. Buffers start zeroed: masked columns must hold finite values.
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
        self.flat_keys: torch.Tensor | None = None  # (capacity * heads * head_dim,)
        self.flat_values: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, h, _, dk = key_states.shape
        self.device = key_states.device
        self.flat_keys = key_states.new_zeros(self.owner.capacity * h * dk)
        self.flat_values = value_states.new_zeros(self.owner.capacity * h * value_states.shape[-1])
        self.heads, self.key_dim, self.value_dim = h, dk, value_states.shape[-1]
        self.is_initialized = True
        self.view()

    def view(self) -> None:
        """(Re)points keys/values at the owner's current layout: (rows, heads, width, dim)."""
        rows, width = self.owner.rows, self.owner.width
        self.keys = self.flat_keys[: rows * self.heads * width * self.key_dim].view(
            rows, self.heads, width, self.key_dim)
        self.values = self.flat_values[: rows * self.heads * width * self.value_dim].view(
            rows, self.heads, width, self.value_dim)

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
        rows = o.row_index[:n]
        self.keys[rows, :, o.positions] = key_states[:, :, 0]
        self.values[rows, :, o.positions] = value_states[:, :, 0]
        return self.keys[:n, :, : o.past + 1], self.values[:n, :, : o.past + 1]

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.owner.past + query_length, 0

    def get_seq_length(self, *args) -> int:
        return self.owner.past

    def get_max_length(self) -> int:
        return self.owner.width

    def reset(self) -> None:
        pass


class KVCache(Cache):
    """`capacity` token slots for every decoder layer, laid out as `rows` x `width`.

    Before each forward the caller says what it is: `prefill(start)` (new rows from `start`) or
    `decode(positions, width)` (rows [0, n), row i writing column positions[i]).
    """

    def __init__(self, num_layers: int, capacity: int):
        self.capacity = capacity
        self.rows = 0
        self.width = 0
        self.start = 0
        self.positions: torch.Tensor | None = None
        self.past = 0  # columns before the first query token, as transformers' code sees it
        self.row_index: torch.Tensor | None = None  # arange(rows), reused by every decode write
        super().__init__(layers=[SlotLayer(self) for _ in range(num_layers)])

    @torch.inference_mode()
    def set_layout(self, rows: int, width: int, keep_rows: int = 0, keep_width: int = 0,
                   device: torch.device | str = "cpu") -> bool:
        """Lays `rows` x `width` slots over the pool, keeping the first keep_rows rows' first
        keep_width columns. Returns whether the layout changed."""
        if rows * width > self.capacity:
            raise ValueError(f"{rows} rows x {width} columns exceed the KV pool's {self.capacity} slots")
        if (rows, width) == (self.rows, self.width):
            return False
        self.rows, self.width = rows, width
        for layer in self.layers:  # one layer at a time: the copy kept aside is one layer's
            if not layer.is_initialized:
                continue
            kept = (layer.keys[:keep_rows, :, :keep_width].clone(), layer.values[:keep_rows, :, :keep_width].clone())
            layer.view()
            layer.keys[:keep_rows, :, :keep_width], layer.values[:keep_rows, :, :keep_width] = kept
        if self.row_index is None:
            # every row index a layout can have, allocated once: captured CUDA graphs hold its address
            self.row_index = torch.arange(self.capacity, device=device)
        return True

    def prefill(self, start: int, offset: int = 0) -> None:
        """Rows from `start` write their tokens from column `offset` on (attending to columns before it)."""
        self.start, self.positions, self.past = start, None, offset

    def decode(self, positions: torch.Tensor, width: int) -> None:
        """Row i writes column positions[i]; attention spans columns [0, width)."""
        self.positions, self.past = positions, width - 1

    @torch.inference_mode()
    def move_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copies slots src[k] -> dst[k] (keeps live rows contiguous from row 0)."""
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys[dst] = layer.keys[src]
                layer.values[dst] = layer.values[src]

    @torch.inference_mode()
    def expand_rows(self, index: torch.Tensor) -> None:
        """Row r becomes a copy of row index[r] (one prompt shared by several continuations);
        the layout grows to len(index) rows of the same width."""
        if len(index) * self.width > self.capacity:
            raise ValueError(f"{len(index)} rows x {self.width} columns exceed the KV pool's {self.capacity} slots")
        self.rows = len(index)
        for layer in self.layers:  # one layer at a time
            if layer.is_initialized:
                copies = layer.keys.index_select(0, index), layer.values.index_select(0, index)
                layer.view()
                layer.keys.copy_(copies[0])
                layer.values.copy_(copies[1])

    @property
    def tokens(self) -> int:
        """Token slots in the current layout: rows x width."""
        return self.rows * self.width

    def nbytes(self) -> int:
        """Bytes of the pool (every layer's keys and values)."""
        return sum(t.numel() * t.element_size() for layer in self.layers if layer.is_initialized
                   for t in (layer.flat_keys, layer.flat_values))
