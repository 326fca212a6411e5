"""The KV pool's blocks: who holds which block, and which blocks hold a cached prefix. No torch.

The pool is `num_blocks` blocks of `block_size` token slots. A running row owns a block table
(a list of block ids, in position order). A full block whose tokens have all been computed is
named by a hash chain over (the name of the block before it, its tokens), salted with what
changes keys and values for the same tokens (model, revision, dtype, KV dtype, quantization),
so one name stands for a whole prefix. Named blocks are shared: a row whose tokens start with
named blocks takes them (reference count + 1) instead of computing and storing its own copy.

A block nobody references goes to the free queue. If it is named it stays cached there, and a
later row can take it back; blocks are reused from the queue's front, least recently freed
first. A row's blocks are queued tail first, so a chain loses its tail before its head (a head
block serves every longer prefix, a tail only its own).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

from engine.api.errors import PoolExhausted


def hash_salt(*parts) -> bytes:
    """The chain's root: whatever changes a block's keys and values besides its tokens."""
    return hashlib.sha256(repr(parts).encode()).digest()


def chain_hashes(tokens: list[int], block_size: int, salt: bytes, limit: int | None = None,
                 known: list[bytes] | None = None) -> list[bytes]:
    """sha256 names of the full blocks among tokens[:limit]; `known` (a prefix of the answer
    computed before) is extended rather than recomputed."""
    end = len(tokens) if limit is None else min(limit, len(tokens))
    names = list(known or [])
    parent = names[-1] if names else salt
    for start in range(len(names) * block_size, end - block_size + 1, block_size):
        block = ",".join(map(str, tokens[start:start + block_size])).encode()
        parent = hashlib.sha256(parent + block).digest()
        names.append(parent)
    return names


class BlockPool:
    """Reference-counted blocks with a least-recently-freed queue that doubles as the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self.refs = [0] * num_blocks
        self.name_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # name -> block holding it (referenced or free)
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.hit_tokens = 0
        """Prompt tokens whose blocks were found cached (since the engine started)."""
        self.queried_tokens = 0
        """Prompt tokens looked up (the hit rate's denominator)."""

    @property
    def num_free(self) -> int:
        """Blocks a row can take now (free ones, cached or not)."""
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------------

    def match(self, names: list[bytes]) -> list[int]:
        """Blocks holding the longest cached prefix of `names` (not yet taken)."""
        if not self.caching:
            return []
        found = []
        for name in names:
            block = self.cached.get(name)
            if block is None:
                break
            found.append(block)
        return found

    def take_cached(self, blocks: list[int]) -> None:
        """References blocks found by `match`; a free one leaves the free queue."""
        for b in blocks:
            if self.refs[b] == 0:
                del self.free[b]
            self.refs[b] += 1

    def table(self, shared: list[int], tokens: int) -> list[int]:
        """A row's block table for `tokens` positions: the `shared` blocks first (a cached prefix,
        or another row's prompt), referenced, then fresh blocks for the rest."""
        self.take_cached(shared)
        return shared + self.allocate(self.blocks_for(tokens) - len(shared))

    def count_lookup(self, tokens: int, hit: int) -> None:
        """A prefix lookup of `tokens` prompt tokens found `hit` of them cached."""
        self.queried_tokens += tokens
        self.hit_tokens += hit

    def name(self, block: int, name: bytes) -> None:
        """Registers a block whose tokens are all computed under its chain name. A name already
        held by another block stays with that one (the duplicate is used, but not shared)."""
        if not self.caching or self.name_of[block] is not None or name in self.cached:
            return
        self.name_of[block] = name
        self.cached[name] = block

    # -- allocation ---------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks (the caller checked num_free); cached free blocks lose their names."""
        if n > len(self.free):
            raise PoolExhausted(f"{n} KV blocks asked for, {len(self.free)} free")
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            name = self.name_of[b]
            if name is not None:
                del self.cached[name]
                self.name_of[b] = None
            self.refs[b] = 1
            out.append(b)
        return out

    def release(self, blocks: list[int]) -> None:
        """Drops one reference to each of a row's blocks; unreferenced ones are queued tail first."""
        for b in reversed(blocks):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if self.name_of[b] is None:
                    self.free[b] = None
                    self.free.move_to_end(b, last=False)  # nothing cached in it: reuse it first
                else:
                    self.free[b] = None

    def reset_cache(self) -> None:
        """Forgets every cached prefix (used after an error that may have left blocks half written)."""
        for name, b in list(self.cached.items()):
            self.name_of[b] = None
        self.cached.clear()
