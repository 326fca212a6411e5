"""Decides which waiting requests run next, under a KV-token budget. Pure logic: no torch.

static:     a batch is formed when the previous one has drained, and runs to completion.
continuous: whenever rows and budget are free, waiting requests join the running batch.

Either way the running batch reserves rows x (widest row's prompt + max_tokens) KV slots,
at most max_batch_tokens, so a request is only started when it can run to its end.
"""
from __future__ import annotations

from engine.sequence import Sequence, Status


class Scheduler:
    """Keeps the waiting queue sorted longest first (memory trouble shows in the first batch,
    not the last; neighbours waste little padding; no long request straggles at the end)."""

    def __init__(self, max_batch_tokens: int, max_num_seqs: int, max_model_len: int,
                 max_prefill_tokens: int | None = None):
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_prefill_tokens = max_prefill_tokens or max_batch_tokens
        self.waiting: list[Sequence] = []
        self._sorted = True

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

    def has_waiting(self) -> bool:
        return bool(self.waiting)

    def next_batch(self) -> list[Sequence]:
        """static: the next batch, taken when the previous one has drained; as many rows as the
        budget allows, sized rows x (longest prompt + largest max_tokens)."""
        self._sort(key=lambda s: (s.num_prompt_tokens, s.params.max_tokens, -s.index))
        batch: list[Sequence] = []
        longest_prompt = largest_max_tokens = 0
        for seq in self.waiting:
            prompt = max(longest_prompt, seq.num_prompt_tokens)
            new = max(largest_max_tokens, seq.params.max_tokens)
            if batch and ((len(batch) + 1) * (prompt + new) > self.max_batch_tokens
                          or len(batch) >= self.max_num_seqs):
                break
            batch.append(seq)
            longest_prompt, largest_max_tokens = prompt, new
        return self._take(len(batch))

    def admit(self, running: int, widest: int) -> list[Sequence]:
        """continuous: the requests that join a batch of `running` rows whose widest row fills
        `widest` columns, taken in queue order while rows, KV budget and prefill budget allow."""
        self._sort(key=lambda s: (s.max_len, s.num_prompt_tokens, -s.index))
        k = longest_prompt = 0
        for seq in self.waiting:
            rows = running + k + 1
            width = max(widest, seq.max_len)
            prompt = max(longest_prompt, seq.num_prompt_tokens)
            if rows > self.max_num_seqs or rows * width > self.max_batch_tokens:
                break
            if k and (k + 1) * prompt > self.max_prefill_tokens:
                break
            k, widest, longest_prompt = k + 1, width, prompt
        return self._take(k)

    def prefill_group(self, pending: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        """Splits off the rows to prefill in one forward pass: rows x longest prompt <= max_prefill_tokens
        (always at least one row)."""
        k = longest = 0
        for seq in pending:
            longest = max(longest, seq.num_prompt_tokens)
            if k and (k + 1) * longest > self.max_prefill_tokens:
                break
            k += 1
        return pending[:k], pending[k:]

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
