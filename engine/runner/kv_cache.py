"""The KV pool: one pair of block buffers per layer, allocated once, addressed through block tables.

Each layer's keys and values live in (num_blocks, kv_heads, block_size, head_dim) buffers.
Which row owns which block is `engine.core.block_pool.BlockPool`'s business; here a forward pass
only says, per token, which slot (block * block_size + offset) its keys and values go to
(`PassMetadata.slot_mapping`), and attention (`engine.runner.attention`) reads rows through their
block tables. The buffers are allocated on the first forward pass (when the layers' head
counts and sizes are known) and never again.

With `kv_dtype` float8 (CUDA, compute capability >= 8.9) the buffers hold keys and values in
fp8 e4m3 (unscaled, vLLM's default): half the bytes of bf16, so twice the tokens per byte.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from engine.runner.attention import PassMetadata
from engine.runner.fast_paths import FastPaths


class PagedLayer(CacheLayerMixin):
    """One layer's blocks. `update` writes the pass's new keys and values into their slots."""

    is_sliding = False
    is_compileable = False

    def __init__(self, owner: "PagedKVCache"):
        super().__init__()
        self.owner = owner
        self.keys: torch.Tensor | None = None  # (num_blocks, kv_heads, block_size, head_dim)
        self.values: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        o = self.owner
        dtype = o.kv_dtype or key_states.dtype
        shape = (o.physical_blocks, key_states.shape[1], o.block_size)
        self.keys = torch.zeros((*shape, key_states.shape[-1]), dtype=dtype, device=key_states.device)
        self.values = torch.zeros((*shape, value_states.shape[-1]), dtype=dtype, device=value_states.device)
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states, value_states (1, kv_heads, T, dim): written at the pass's slots."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        slots = self.owner.meta.slot_mapping
        bs = self.owner.block_size
        blocks, offsets = slots // bs, slots % bs
        self.keys[blocks, :, offsets] = key_states[0].transpose(0, 1).to(self.keys.dtype)  # (T, H, D)
        self.values[blocks, :, offsets] = value_states[0].transpose(0, 1).to(self.values.dtype)
        return key_states, value_states

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return query_length, 0

    def get_seq_length(self, *args) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        pass


class PagedKVCache(Cache):
    """`num_blocks` blocks of `block_size` token slots for every decoder layer, and one spare
    block (`scratch_block`) that no row owns: the padding rows of a replayed decode graph write
    their keys and values there (engine.runner.cuda_graph)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_dtype: torch.dtype | None = None,
                 paths: FastPaths | None = None):
        self.paths = paths
        """The engine's fast paths (engine.runner.fast_paths): which attention kernels it trusts;
        None (a pool built outside an engine) = every kernel without a check."""
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks
        """Index of the spare block (past the pool's blocks)."""
        self.physical_blocks = num_blocks + 1
        """Blocks the buffers hold: the pool's and the spare one."""
        self.block_size = block_size
        self.kv_dtype = kv_dtype
        self.key = 0
        """Names this pool in the commands rank 0 sends the other tensor-parallel ranks."""
        self.meta: PassMetadata | None = None
        """Where the tokens of the pass being run go (set by the model runner before each forward)."""
        super().__init__(layers=[PagedLayer(self) for _ in range(num_layers)])

    @property
    def capacity(self) -> int:
        """Token slots in the pool."""
        return self.num_blocks * self.block_size

    @property
    def allocated(self) -> bool:
        return all(layer.is_initialized for layer in self.layers)

    def nbytes(self) -> int:
        """Bytes of the pool (every layer's keys and values, the spare block's too; 0 before the
        first forward pass)."""
        return sum(t.numel() * t.element_size() for layer in self.layers if layer.is_initialized
                   for t in (layer.keys, layer.values))

    @torch.inference_mode()
    def copy_block(self, src: int, dst: int) -> None:
        """Block dst becomes a copy of block src (a shared partial block written by a new owner)."""
        for layer in self.layers:
            if layer.is_initialized:
                layer.keys[dst] = layer.keys[src]
                layer.values[dst] = layer.values[src]
