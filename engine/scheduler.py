"""Decides what the next forward pass does, under a KV-token budget. Pure logic: no torch.

static:     a batch is formed when the previous one has drained, and runs to completion.
continuous: whenever rows and budget are free, waiting requests join the running batch.

Either way the running batch reserves rows x (widest row's prompt + max_tokens) KV slots
(`kv_tokens`, the one place that rule is written), at most max_batch_tokens, so a request is
only started when it can run to its end.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from engine.sequence import Sequence, Status


def kv_tokens(rows: int, width: int) -> int:
    """KV slots a batch of `rows` rows reserves when its widest row may fill `width` columns."""
    return rows * width


def pool_capacity(max_batch_tokens: int, max_num_seqs: int, width_align: int) -> int:
    """Token slots the KV pool needs: the budget, plus the slack that width rounding may take."""
    return max_batch_tokens + max_num_seqs * (width_align - 1)


CPU_PREFILL_TOKENS = 1024
"""On CPU a prefill of ~1k tokens already keeps every core busy, and smaller groups pad less
(scripts/bench_batching.py, workload c); a GPU wants as many tokens per pass as it can get."""


def prefill_capacity(max_prefill_tokens: int | None, max_batch_tokens: int, on_cpu: bool = False) -> int:
    """Most prompt tokens prefilled in one forward pass: the configured value, else
    CPU_PREFILL_TOKENS on CPU (never above max_batch_tokens) and max_batch_tokens elsewhere."""
    if max_prefill_tokens is not None:
        return max_prefill_tokens
    return min(max_batch_tokens, CPU_PREFILL_TOKENS) if on_cpu else max_batch_tokens


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass
class SchedulerOutput:
    """The plan of one forward pass, handed from the scheduler to the model runner."""

    prefill: list[Sequence] = field(default_factory=list)
    """Requests whose prompts this pass prefills (they join the batch as new rows); empty for a decode."""
    num_decode_rows: int = 0
    """Running rows that each decode one token (0 when this pass is a prefill)."""
    layout: tuple[int, int] | None = None
    """(slots, width) the KV pool must be laid out as before this pass; None = keep the current one."""

    @property
    def is_prefill(self) -> bool:
        return bool(self.prefill)

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.num_decode_rows


class Scheduler:
    """Keeps the waiting queue sorted longest first (memory trouble shows in the first batch,
    not the last; neighbours waste little padding; no long request straggles at the end)."""

    def __init__(self, max_batch_tokens: int, max_num_seqs: int, max_model_len: int,
                 max_prefill_tokens: int | None = None, continuous: bool = False, width_align: int = 1,
                 cached_tokens: Callable[[Sequence], int] | None = None, min_join_fraction: float = 0.0):
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_prefill_tokens = prefill_capacity(max_prefill_tokens, max_batch_tokens)
        self.continuous = continuous
        self.width_align = width_align
        """Layout widths are rounded up to this (CUDA graphs are captured per layout: fewer layouts)."""
        self.min_join_fraction = min_join_fraction
        """continuous: while rows run, waiting requests join only once at least this share of the
        batch's rows could join at once (each prefill pass has a fixed cost; fewer, larger ones)."""
        self.cached_tokens = cached_tokens or (lambda seq: 0)
        """Leading prompt tokens of a request that the prefix cache holds (they cost no prefill)."""
        self.waiting: list[Sequence] = []
        self.pending: list[Sequence] = []  # admitted to the batch, prompt not yet prefilled
        self.layout = (0, 0)  # (slots, width) of the KV pool's current layout
        self._sorted = True

    @property
    def pool_capacity(self) -> int:
        return pool_capacity(self.max_batch_tokens, self.max_num_seqs, self.width_align)

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
        if need > self.max_batch_tokens:
            return f"{what} exceeds max_batch_tokens ({self.max_batch_tokens})"
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.pending)

    def has_waiting(self) -> bool:
        return bool(self.waiting)

    def schedule(self, running: int, widest: int) -> SchedulerOutput:
        """The next pass for a batch of `running` rows whose widest row fills `widest` columns:
        a prefill of (some of) the admitted requests, else a decode of every running row."""
        if not self.pending:
            if self.continuous:
                self.pending = self.admit(running, widest)
            elif running == 0:
                self.pending = self.next_batch()
        if not self.pending:
            return SchedulerOutput(num_decode_rows=running)
        width = max(widest, *(s.max_len for s in self.pending))
        layout = self._layout_for(running + len(self.pending), width)
        group, self.pending = self.prefill_group(self.pending)
        return SchedulerOutput(prefill=group, layout=layout)

    def _layout_for(self, rows: int, width: int) -> tuple[int, int] | None:
        """The KV layout a batch of `rows` rows of up to `width` columns needs, or None when the
        current one already holds it (then nothing moves and captured graphs stay valid)."""
        slots, cur_width = self.layout
        if slots >= rows and cur_width >= width:
            return None
        width = round_up(width, self.width_align)
        # As many slots as the pool holds at this width: later (narrower) batches then fit the
        # same layout, and continuous mode has room to refill.
        slots = max(rows, min(self.max_num_seqs, self.pool_capacity // width))
        self.layout = (slots, width)
        return self.layout

    def next_batch(self) -> list[Sequence]:
        """static: the next batch, taken when the previous one has drained; as many rows as the
        budget allows, sized rows x (longest prompt + largest max_tokens)."""
        self._sort(key=lambda s: (s.num_prompt_tokens, s.params.max_tokens, -s.index))
        k = longest_prompt = largest_max_tokens = 0
        for seq in self.waiting:
            prompt = max(longest_prompt, seq.num_prompt_tokens)
            new = max(largest_max_tokens, seq.params.max_tokens)
            if k and (kv_tokens(k + 1, prompt + new) > self.max_batch_tokens or k >= self.max_num_seqs):
                break
            k, longest_prompt, largest_max_tokens = k + 1, prompt, new
        return self._take(k)

    def admit(self, running: int, widest: int) -> list[Sequence]:
        """continuous: the requests that join a batch of `running` rows whose widest row fills
        `widest` columns, taken in queue order while rows, KV budget and prefill budget allow."""
        self._sort(key=lambda s: (s.max_len, s.num_prompt_tokens, -s.index))
        k = longest_prompt = 0
        for seq in self.waiting:
            rows = running + k + 1
            width = max(widest, seq.max_len)
            prompt = max(longest_prompt, self._prefill_len(seq))
            if rows > self.max_num_seqs or kv_tokens(rows, width) > self.max_batch_tokens:
                break
            if k and kv_tokens(k + 1, prompt) > self.max_prefill_tokens:
                break
            k, widest, longest_prompt = k + 1, width, prompt
        if running and k < len(self.waiting) and k < self.min_join_fraction * (running + k):
            return []  # too few rows free yet: keep decoding
        return self._take(k)

    def prefill_group(self, pending: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        """Splits off the rows to prefill in one forward pass: rows x longest prompt (less its
        cached prefix) <= max_prefill_tokens (always at least one row)."""
        k = longest = 0
        for seq in pending:
            longest = max(longest, self._prefill_len(seq))
            if k and kv_tokens(k + 1, longest) > self.max_prefill_tokens:
                break
            k += 1
        return pending[:k], pending[k:]

    def _prefill_len(self, seq: Sequence) -> int:
        """Prompt tokens a prefill of `seq` computes."""
        return seq.num_prompt_tokens - self.cached_tokens(seq)

    def _sort(self, key) -> None:
        if not self._sorted:
            self.waiting.sort(key=key, reverse=True)
            self._sorted = True

    def _take(self, k: int) -> list[Sequence]:
        taken = self.waiting[:k]
        del self.waiting[:k]
        for seq in taken:
            seq.status = Status.RUNNING
        return taken
