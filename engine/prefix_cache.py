"""Prefix caching: keys and values of full blocks of prompt tokens, computed once, reused.

A prompt's tokens are cut into blocks of BLOCK_SIZE; block i is named by a hash chain,
hash(name of block i-1, its tokens), so a name stands for the whole prefix up to that block (a
token's keys and values depend on every token before it and on its position, both fixed by the
chain; the model and dtype are the engine's own). After a prefill, each row's full prompt
blocks are copied from its KV slot into a store of `capacity` tokens; a later row whose prompt
starts with cached blocks gets them copied into its slot and prefills only the rest. The store
is allocated once (on first use) and keeps blocks across batches and `generate` calls;
when it is full the least recently used block goes.

Blocks are copied into each row's own slot (the slot layout has no block table), so a reused
block saves its prefill compute, not KV memory: the admission budget still counts it per row.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from engine.kv_cache import KVCache

BLOCK_SIZE = 16


def block_hashes(tokens: list[int], limit: int | None = None) -> list[int]:
    """Chain hashes of the full blocks among tokens[:limit]."""
    end = len(tokens) if limit is None else min(limit, len(tokens))
    hashes, parent = [], 0
    for start in range(0, end - BLOCK_SIZE + 1, BLOCK_SIZE):
        parent = hash((parent, tuple(tokens[start:start + BLOCK_SIZE])))
        hashes.append(parent)
    return hashes


class PrefixCache:
    """`capacity` tokens of cached blocks for one KV pool."""

    def __init__(self, cache: KVCache, capacity: int):
        self.cache = cache
        self.num_blocks = capacity // BLOCK_SIZE
        self.blocks: OrderedDict[int, int] = OrderedDict()  # block hash -> store index, least recent first
        self.free = list(range(self.num_blocks))[::-1]
        self.keys: list[torch.Tensor] = []  # per layer (num_blocks, heads, BLOCK_SIZE, dim)
        self.values: list[torch.Tensor] = []
        self.prompt_tokens = 0
        """Prompt tokens prefilled since the engine started (generation and scoring)."""
        self.hit_tokens = 0
        """Of those, tokens whose keys and values came from the cache."""

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def match(self, tokens: list[int]) -> int:
        """Leading tokens of `tokens` whose blocks are cached (a multiple of BLOCK_SIZE; always
        leaves the last prompt token to compute, since its logits pick the first new token)."""
        n = 0
        for h in block_hashes(tokens, len(tokens) - 1):
            if h not in self.blocks:
                break
            n += BLOCK_SIZE
        return n

    @torch.inference_mode()
    def load(self, rows, prompts: list[list[int]], offset: int) -> None:
        """Copies the first `offset` tokens' cached keys and values into slots `rows`; rows with
        the same prefix share one read of the store."""
        self.prompt_tokens += sum(len(p) for p in prompts)
        self.hit_tokens += offset * len(prompts)
        if not offset:
            return
        by_chain: dict[tuple[int, ...], list[int]] = {}
        for row, tokens in zip(rows, prompts):
            by_chain.setdefault(tuple(block_hashes(tokens, offset)), []).append(row)
        device = self.keys[0].device
        for chain, chain_rows in by_chain.items():
            for h in chain:
                self.blocks.move_to_end(h)
            idx = torch.tensor([self.blocks[h] for h in chain], device=device)
            dst = torch.tensor(chain_rows, device=device)
            for layer, keys, values in zip(self.cache.layers, self.keys, self.values):
                for store, buf in ((keys, layer.keys), (values, layer.values)):
                    blocks = store.index_select(0, idx).transpose(0, 1)  # (H, nb, B, D)
                    prefix = blocks.reshape(blocks.shape[0], offset, blocks.shape[-1])  # (H, offset, D)
                    buf[dst, :, :offset] = prefix[None].expand(len(chain_rows), -1, -1, -1)

    @torch.inference_mode()
    def store(self, rows, prompts: list[list[int]]) -> None:
        """Caches the full prompt blocks of slots `rows` that are not cached yet."""
        if not self.num_blocks:
            return
        self._allocate()
        for row, tokens in zip(rows, prompts):
            hashes = block_hashes(tokens)
            new = [i for i, h in enumerate(hashes) if h not in self.blocks]
            for h in hashes:
                if h in self.blocks:
                    self.blocks.move_to_end(h)
            # a prompt longer than the store keeps its first blocks (a match needs the chain from
            # block 0) and never evicts its own chain
            new = new[: self.num_blocks - (len(hashes) - len(new))]
            for i in new:
                self.blocks[hashes[i]] = self._take()
            for first, last in _runs(new):
                self._copy_in(row, first, last, [self.blocks[hashes[i]] for i in range(first, last)])

    def _copy_in(self, row: int, first: int, last: int, slots: list[int]) -> None:
        """Blocks [first, last) of slot `row` -> store blocks `slots`."""
        dst = torch.tensor(slots, device=self.keys[0].device)
        cols = slice(first * BLOCK_SIZE, last * BLOCK_SIZE)
        for layer, keys, values in zip(self.cache.layers, self.keys, self.values):
            for store, buf in ((keys, layer.keys), (values, layer.values)):
                h, d = buf.shape[1], buf.shape[3]
                # (H, n * B, D) -> (n, H, B, D)
                store[dst] = buf[row, :, cols].reshape(h, last - first, BLOCK_SIZE, d).transpose(0, 1)

    @torch.inference_mode()
    def shared_prefix(self, runner, rows: list[int], prompts: list[list[int]]) -> int:
        """For rows prefilled together (choice scoring): computes the full blocks that all
        `prompts` share once, if they are not cached yet (in slot rows[0]), then copies the
        longest prefix cached for all of them into their slots. Returns that prefix's length."""
        if len(prompts) > 1:
            first = prompts[0]
            common = min(len(p) for p in prompts) - 1
            for p in prompts[1:]:
                common = next((i for i, (a, b) in enumerate(zip(first[:common], p)) if a != b), common)
            shared = common // BLOCK_SIZE * BLOCK_SIZE
            if shared and self.match(first[: shared + 1]) < shared:
                ids = torch.tensor([first[:shared]], device=runner.device)
                runner.prefill(self.cache, rows[0], ids, torch.tensor([shared], device=runner.device))
                self.store(rows[:1], [first[:shared]])
        offset = min(self.match(p) for p in prompts)
        self.load(rows, prompts, offset)
        return offset

    def _take(self) -> int:
        """A free store block, evicting the least recently used one when none is free."""
        if self.free:
            return self.free.pop()
        _, slot = self.blocks.popitem(last=False)
        return slot

    def _allocate(self) -> None:
        if self.keys:
            return
        for layer in self.cache.layers:
            shape = (self.num_blocks, layer.heads, BLOCK_SIZE)
            self.keys.append(layer.flat_keys.new_zeros((*shape, layer.key_dim)))
            self.values.append(layer.flat_values.new_zeros((*shape, layer.value_dim)))

    def nbytes(self) -> int:
        """Bytes of the store (0 until the first block is cached)."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


def _runs(indexes: list[int]):
    """(first, last + 1) of each run of consecutive integers in the sorted `indexes`."""
    start = prev = None
    for i in indexes:
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            yield start, prev + 1
            start = prev = i
    if start is not None:
        yield start, prev + 1
