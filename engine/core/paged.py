"""What a pass over the paged KV pool needs from the engine that owns it: the pieces, never the
engine. Pooling on a decoder and choice scoring run such passes; they get this record, so
nothing below the engine holds the engine, and an engine dropped by its last reference is freed
at once (its weights, its KV pool, its tensor-parallel ranks), not when the cyclic collector runs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from engine.core.block_pool import BlockPool
from engine.core.sequence import Sequence


@dataclass(frozen=True)
class PagedPass:
    runner: Any
    """The engine's ModelRunner: run(cache, chunks), hidden_states, copy_block, vocab_size, dtype."""
    cache: Any
    """The KV pool's tensors (the runner's cache object)."""
    pool: BlockPool
    """The KV pool's blocks: allocation, prefix names."""
    max_num_batched_tokens: int
    """Most tokens one pass computes."""
    max_model_len: int
    """Longest prompt + generated tokens a row may have."""
    stamp: Callable[[Sequence], Sequence]
    """Marks a row with its adapter's slot and salt (the LoRA router's)."""
    salt_of: Callable[[Sequence], bytes]
    """The root of a row's block names (the scheduler's)."""

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def pool_tokens(self) -> int:
        return self.pool.num_blocks * self.pool.block_size
