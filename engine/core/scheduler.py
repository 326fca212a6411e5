"""Decides what the next forward pass computes, over a paged KV pool. Pure logic: no torch.

Every pass carries chunks: each running row's next tokens (one for a decoding row, up to the
rest of its prompt for a row still prefilling), under `max_num_batched_tokens` real tokens.
Rows already running go first, in the order they were admitted; waiting requests are admitted
after them when the pool has free blocks for what they need now (prompt + the next token, less
the blocks a cached prefix gives them), not prompt + max_tokens.

When a running row needs a block and none is free, the most recently admitted row is
preempted by recompute (vLLM's default): its blocks are freed (their cached names stay, so a
recompute mostly finds them) and it goes back to the front of the queue with its output so far.

static:     a batch (a cohort of up to max_num_seqs requests) forms when the previous one has
            drained; its rows are admitted on demand, a preempted row rejoins it, no new row does.
continuous: any waiting request is admitted whenever rows and blocks allow.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from engine.core.block_pool import BlockPool, chain_hashes
from engine.core.lora_slots import LoRASlots
from engine.core.sequence import Sequence, Status

CPU_BATCHED_TOKENS = 1024
"""On CPU a pass of ~1k tokens already keeps every core busy (scripts/bench_batching.py)."""
CUDA_BATCHED_TOKENS = 8192
WATERMARK = 0.01
"""Share of the pool's blocks a new admission leaves free, so running rows can grow a while
before anyone is preempted (vLLM keeps the same 1%)."""
GROWTH_STEP = 0.25
"""Each preemption makes admission expect every row to generate this much more of its remaining
max_tokens (Scheduler.growth, up to all of it), and admit a row only if the peak of the rows'
projected growth fits (Projection): once rows are seen to outgrow the pool, new rows wait for
room instead of being admitted only to be preempted and recomputed."""
GROWTH_DECAY = 0.02
"""...and each finished row lowers it by this much, so a job whose outputs stop early goes back to
admitting rows for their prompts alone."""


def batched_tokens(configured: int | None, on_cpu: bool) -> int:
    """Real tokens one forward pass may carry: the configured value, else 1,024 on CPU and
    8,192 elsewhere."""
    if configured is not None:
        return configured
    return CPU_BATCHED_TOKENS if on_cpu else CUDA_BATCHED_TOKENS


@dataclass
class ScheduledChunk:
    """Tokens [start, start + count) of one row, computed in this pass."""

    seq: Sequence
    """The row."""
    start: int
    """Its first position computed here (the tokens before it are in the pool)."""
    count: int
    """Tokens computed (1 for a decoding row)."""

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the row's last token, whose logits pick its next token."""
        return self.start + self.count == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    """What the scheduler chose for one step (one forward pass), handed to the model runner."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    """What the pass computes, row by row (running rows first, then newly admitted ones)."""
    admitted: list[Sequence] = field(default_factory=list)
    """Rows that join the running table before this pass (new, or back after a preemption)."""
    preempted: list[Sequence] = field(default_factory=list)
    """Rows that left the running table before this pass; their blocks are free again."""

    @property
    def num_tokens(self) -> int:
        return sum(c.count for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    """The waiting queue (longest first: memory trouble shows early, no long request straggles
    at the end), the running rows in admission order, and the block pool they share."""

    def __init__(self, pool: BlockPool, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int,
                 continuous: bool = False, salt: bytes = b"", long_rope_after: int | None = None,
                 lora_slots: LoRASlots | None = None):
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.continuous = continuous
        self.salt = salt
        self.long_rope_after = long_rope_after
        """LongRoPE's original length, or None: a longer prompt's keys are computed with the long
        factors, so its blocks must not be shared with a shorter prompt's (see salt_of)."""
        self.lora_slots = lora_slots
        """With LoRA: the adapters' device slots; a row is admitted only once its adapter holds one."""
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.cohort: list[Sequence] = []
        """static: the current batch's rows not yet admitted (or preempted back out of it)."""
        self.inflight: dict[bytes, Sequence] = {}
        """Names of prompt blocks an admitted row is computing: a row needing one waits for it."""
        self.preemptions = 0
        self.growth = 0.0
        """Share of their remaining max_tokens that admission expects rows to generate: 0 (rows
        are admitted for prompt + next token) until the pool runs out; see GROWTH_STEP."""
        self._sorted = True
        self.collect_tokens = max_num_batched_tokens
        """Most prompt tokens that rows collecting prompt logprobs compute in one pass (each keeps
        its logits: the engine bounds their bytes, engine.sample.prompt_logprobs)."""

    # -- requests -----------------------------------------------------------------------------

    def add(self, seq: Sequence) -> bool:
        """Queues `seq`, or fails it with a message naming the limit it can never fit. Returns queued?"""
        reason = self.rejection(seq)
        if reason:
            seq.fail(reason)
            return False
        self.waiting.append(seq)
        self._sorted = False
        return True

    def rejection(self, seq: Sequence) -> str | None:
        """Why `seq` can never run, or None."""
        if seq.num_prompt_tokens == 0:
            return "empty prompt: a request needs at least one prompt token"
        need = seq.max_len
        what = f"prompt ({seq.num_prompt_tokens} tokens) + max_tokens ({seq.params.max_tokens}) = {need}"
        if need > self.max_model_len:
            return f"{what} exceeds max_model_len ({self.max_model_len})"
        pool_tokens = self.pool.num_blocks * self.pool.block_size
        if need > pool_tokens:
            return f"{what} exceeds the KV pool: max_batch_tokens ({pool_tokens})"
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.cohort)

    def has_waiting(self) -> bool:
        return bool(self.waiting or self.cohort)

    # -- choosing a step ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self._collect = self.collect_tokens
        bs = self.pool.block_size
        chunks = out.chunks
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            start = seq.num_computed_tokens
            n = min(seq.num_tokens - start, budget)
            if seq.collects_prompt_logprobs:
                n = self._collected(n)
                if not n:
                    continue
            # most passes a row's blocks already hold its next token: no growth to consider
            if start + n > len(seq.block_ids) * bs and not self._grow(seq, start + n, out):
                continue
            chunks.append(ScheduledChunk(seq, start, n))
            budget -= n
        if not out.preempted:
            self._admit(out, budget)
        return out

    def _collected(self, n: int) -> int:
        """Tokens of a row collecting prompt logprobs this pass: what is left of collect_tokens."""
        n = min(n, self._collect)
        self._collect -= n
        return n

    def _grow(self, seq: Sequence, tokens: int, out: SchedulerOutput) -> bool:
        """Gives `seq` the blocks `tokens` positions need, preempting the most recently admitted
        rows while none are free. False when `seq` itself was preempted."""
        need = self.pool.blocks_for(tokens) - len(seq.block_ids)
        while need > self.pool.num_free:
            victim = self.running[-1]
            self.preempt(victim)
            self.growth = min(1.0, self.growth + GROWTH_STEP)
            out.preempted.append(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.block_ids += self.pool.allocate(need)
        return True

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        queue = self._queue()
        if not queue:  # nothing may be admitted now
            return
        watermark = int(WATERMARK * self.pool.num_blocks)
        projection = Projection(self.running, self.pool, self.growth) if self.growth else None
        i = 0
        while i < len(queue) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = queue[i]
            names = self._lookup_names(seq)
            cached = self.pool.match(names)
            nxt = names[len(cached)] if len(cached) < len(names) else None
            if nxt is not None and nxt in self.inflight:
                i += 1  # another row is computing this block right now: share it once it is done
                continue
            need = self.pool.blocks_for(seq.num_tokens + 1) - len(cached)
            free_after = self.pool.num_free - need - sum(self.pool.refs[b] == 0 for b in cached)
            floor = watermark if self.running else 0
            if free_after < floor:
                break
            if projection is not None and not projection.fits(seq, need, free_after - floor):
                break
            if seq.lora is not None:
                seq.lora_slot = self.lora_slots.acquire(seq.lora)
                if seq.lora_slot is None:  # every slot is pinned by other adapters' rows: a later wave
                    i += 1
                    continue
            del queue[i]
            seq.block_ids = self.pool.table(cached, seq.num_tokens + 1)
            seq.num_computed_tokens = len(cached) * self.pool.block_size
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
            self.pool.count_lookup(seq.num_tokens, seq.num_computed_tokens)
            if seq.collects_prompt_logprobs and self.pool.caching:  # it looked none up, but computes them all:
                names = self._names(seq, seq.num_tokens - 1)  # its sibling samples wait to share them
            for name in names[len(cached):]:
                self.inflight.setdefault(name, seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.admitted.append(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if seq.collects_prompt_logprobs:
                n = max(1, self._collected(n))  # admitted: it computes at least one token now
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n

    def _queue(self) -> list[Sequence] | None:
        """The requests that may be admitted now, in order (a list to take them from)."""
        if not self._sorted:
            key = (lambda s: (s.max_len, s.num_prompt_tokens, -s.index)) if self.continuous else (
                lambda s: (s.num_prompt_tokens, s.params.max_tokens, -s.index))
            fresh = [s for s in self.waiting if not s.output_token_ids]
            back = [s for s in self.waiting if s.output_token_ids]  # preempted: they go first
            self.waiting = back + sorted(fresh, key=key, reverse=True)
            self._sorted = True
        if self.continuous:
            return self.waiting
        if not self.running and not self.cohort:  # the previous batch has drained: form the next
            self.cohort = self._form_cohort()
        return self.cohort

    def _form_cohort(self) -> list[Sequence]:
        """static: the next batch, up to max_num_seqs requests whose prompts fit the pool together
        (a block several of them share counts once)."""
        k, blocks, seen = 0, 0, set()
        for seq in self.waiting:
            names = self._lookup_names(seq)
            blocks += self.pool.blocks_for(seq.num_tokens + 1) - sum(n in seen for n in names)
            seen.update(names)
            if k and (k >= self.max_num_seqs or blocks > self.pool.num_blocks):
                break
            k += 1
        cohort, self.waiting = self.waiting[:k], self.waiting[k:]
        return cohort

    def salt_of(self, seq: Sequence) -> bytes:
        """The root of the row's block names: the engine's salt, set apart by the row's adapter (its
        keys and values differ from the base model's) and for a prompt longer than LongRoPE's
        original length (its keys use the long factors from the first position)."""
        salt = self.salt + (b"|lora|" + seq.lora_salt if seq.lora_salt else b"")
        if self.long_rope_after is not None and seq.num_prompt_tokens > self.long_rope_after:
            return salt + b"|long-rope"
        return salt

    def _lookup_names(self, seq: Sequence) -> list[bytes]:
        """The names of the row's full blocks to look up in the prefix cache on admission (none
        without caching, or while the row collects prompt logprobs)."""
        if not self.pool.caching or seq.collects_prompt_logprobs:
            return []
        return self._names(seq, seq.num_tokens - 1)

    def _names(self, seq: Sequence, limit: int) -> list[bytes]:
        """Chain names of the full blocks among the row's first `limit` tokens (memoised)."""
        if len(seq.block_names) < limit // self.pool.block_size:
            seq.block_names = chain_hashes(seq.named_tokens, self.pool.block_size, self.salt_of(seq), limit,
                                           seq.block_names)
        return seq.block_names[: limit // self.pool.block_size]

    # -- after the pass -----------------------------------------------------------------------

    def update(self, step: SchedulerOutput) -> None:
        """The pass ran: its tokens are in the pool, and full blocks get their names (shareable)."""
        bs = self.pool.block_size
        for chunk in step.chunks:
            seq = chunk.seq
            before = seq.num_computed_tokens // bs
            seq.num_computed_tokens = chunk.start + chunk.count
            after = seq.num_computed_tokens // bs
            if after > before and self.pool.caching:
                names = self._names(seq, after * bs)
                for i in range(before, after):
                    self.pool.name(seq.block_ids[i], names[i])
                    if self.inflight.get(names[i]) is seq:
                        del self.inflight[names[i]]

    def finish(self, seqs: list[Sequence]) -> None:
        """Finished rows leave: their blocks go back to the pool (named ones stay cached)."""
        for seq in seqs:
            self._leave(seq)
        if self.growth and seqs:
            self.growth = max(0.0, self.growth - GROWTH_DECAY * len(seqs))

    def abort(self) -> list[Sequence]:
        """Drops every request, running or waiting: running rows give their blocks back (named
        blocks stay cached; a pass that failed named none of its blocks). Returns them."""
        seqs = self.running + self.cohort + self.waiting
        for seq in list(self.running):
            self._leave(seq)
        self.waiting, self.cohort = [], []
        self.inflight.clear()
        return seqs

    def preempt(self, seq: Sequence) -> None:
        """Frees a running row's blocks and queues it first, to be recomputed from its tokens."""
        self._leave(seq)
        seq.status = Status.WAITING
        seq.num_computed_tokens = 0
        seq.preemptions += 1
        self.preemptions += 1
        (self.waiting if self.continuous else self.cohort).insert(0, seq)

    def _leave(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self.pool.release(seq.block_ids)
        seq.block_ids = []
        if seq.lora_slot is not None:
            self.lora_slots.release(seq.lora_slot)
            seq.lora_slot = None
        for name in [n for n, s in self.inflight.items() if s is seq]:
            del self.inflight[name]


class Projection:
    """The running rows' demand for blocks over the coming steps, if each generates `growth` of
    its remaining max_tokens and then finishes: admission's test once rows have outgrown the pool.

    Rows end at different times, and a row that ends frees its blocks for the rows still
    growing, so the room a batch needs is the peak over time of what its rows hold, not the sum
    of what each holds at its end: rows ending in 10 steps leave their blocks to rows ending in
    400. The peak is taken at each row's last step (just before it frees its blocks), decode
    rows gaining one token a step."""

    def __init__(self, running: list[Sequence], pool: BlockPool, growth: float):
        self.pool = pool
        self.growth = growth
        self.rows = [self._row(s, len(s.block_ids), self._own(s)) for s in running]
        """(tokens now, tokens at the end, blocks held, blocks only it holds) per running row."""

    def _own(self, seq: Sequence) -> int:
        return sum(self.pool.refs[b] == 1 for b in seq.block_ids)

    def _row(self, seq: Sequence, held: int, own: int) -> tuple[int, int, int, int]:
        now = seq.num_tokens + 1
        left = seq.params.max_tokens - seq.num_output_tokens
        return now, min(seq.max_len, now + math.ceil(self.growth * left)), held, own

    def peak(self, rows: list[tuple[int, int, int, int]]) -> int:
        """Most blocks the rows take beyond what they hold now, over the steps until they end
        (blocks that rows ending earlier free count against it)."""
        now, end, held, own = np.array(rows, dtype=np.int64).T
        steps = np.unique(end - now)[:, None]  # (T, 1): each row's last step
        running = (end - now)[None, :] >= steps  # (T, N)
        grown = -(-np.minimum(now[None, :] + steps, end[None, :]) // self.pool.block_size) - held
        need = np.where(running, grown, -own[None, :]).sum(axis=1)
        return max(0, int(need.max()))

    def fits(self, seq: Sequence, blocks_now: int, free: int) -> bool:
        """Whether `seq`, given `blocks_now` blocks now (after which `free` blocks are left above
        the watermark), keeps the peak of every row's growth within those `free` blocks; if it
        does, it counts among the rows from here on."""
        row = self._row(seq, self.pool.blocks_for(seq.num_tokens + 1), blocks_now)
        rows = self.rows + [row]
        if self.peak(rows) > free:
            return False
        self.rows = rows
        return True
