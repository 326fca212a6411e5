"""What a batch cost: the rows, tokens and passes between the table's first row joining and its
emptying again, as one BatchStats. Pure bookkeeping: no torch."""
from __future__ import annotations

import time

from engine.api.outputs import BatchStats
from engine.core.scheduler import SchedulerOutput
from engine.core.sequence import Sequence


class StatsCollector:
    """Counts one batch at a time: `join` opens it, `count_pass` adds each forward pass, `close`
    hands it back. A batch is one static batch, or in continuous mode every request of a call."""

    def __init__(self):
        self.stats: BatchStats | None = None
        """The open batch's figures so far; None between batches."""
        self.started = 0.0
        self._seen: dict[int, Sequence] = {}  # id(seq) -> seq, every row of the open batch

    @property
    def open(self) -> bool:
        return self.stats is not None

    def join(self, seqs: list[Sequence], running: int) -> None:
        """`seqs` join a table already holding `running` rows (a row back from a preemption is
        counted once)."""
        if self.stats is None:
            self.stats = BatchStats(rows=0, max_prompt_len=0, max_new_tokens=0, reserved_tokens=0,
                                    prompt_tokens=0, padded_prompt_tokens=0)
            self.started = time.perf_counter()
            self._seen = {}
        st = self.stats
        fresh = [s for s in seqs if id(s) not in self._seen]
        st.rows += len(fresh)
        st.peak_rows = max(st.peak_rows, running + len(seqs))
        if fresh:
            st.max_prompt_len = max(st.max_prompt_len, *(s.num_prompt_tokens for s in fresh))
            st.max_new_tokens = max(st.max_new_tokens, *(s.params.max_tokens for s in fresh))
        st.prompt_tokens += sum(s.num_prompt_tokens for s in fresh)
        st.cached_prompt_tokens += sum(s.num_cached_tokens or 0 for s in fresh)
        for s in seqs:
            self._seen[id(s)] = s

    def count_pass(self, plan: SchedulerOutput, used_tokens: int) -> None:
        """A forward pass of `plan` ran: its tokens, and the KV tokens in use after it."""
        st = self.stats
        decode_rows = prompt_tokens = 0
        for c in plan.chunks:
            if c.count == 1 and c.start >= len(c.seq.prompt_token_ids):
                decode_rows += 1
            else:
                prompt_tokens += c.count
        if decode_rows == len(plan.chunks):
            st.decode_steps += 1
        else:
            st.prefill_steps += 1
        st.computed_rows += decode_rows
        st.padded_prompt_tokens += prompt_tokens
        st.reserved_tokens = max(st.reserved_tokens, used_tokens)
        st.preemptions += len(plan.preempted)

    def close(self) -> BatchStats:
        """The figures of the rows that went through since the table was last empty."""
        st, self.stats = self.stats, None
        st.generated_tokens = sum(s.num_output_tokens for s in self._seen.values())
        st.seconds = time.perf_counter() - self.started
        return st

    def drop(self) -> None:
        """Forgets the open batch (its requests were aborted)."""
        self.stats = None
