"""Forms static batches under a KV-token budget. Pure logic: no torch."""
from __future__ import annotations

from engine.sequence import Sequence, Status


class Scheduler:
    """Packs waiting requests into padded batches.

    A static batch reserves rows x (longest prompt + largest max_tokens) KV slots, so requests
    are sorted by length first: neighbours in the sorted order waste little padding.
    """

    def __init__(self, max_batch_tokens: int, max_num_seqs: int, max_model_len: int):
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
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
        """Takes the next batch off the queue: longest requests first, as many rows as the budget allows."""
        if not self._sorted:
            # Longest first: memory trouble shows up in the first batch, not the last.
            self.waiting.sort(key=lambda s: (s.num_prompt_tokens, s.params.max_tokens, -s.index), reverse=True)
            self._sorted = True
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
        del self.waiting[: len(batch)]
        for seq in batch:
            seq.status = Status.RUNNING
        return batch
