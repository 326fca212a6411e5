"""The running batch: rows sharing one slot-addressed KV cache, progress kept as tensors.

Rows join through a prefill (their prompts, right-padded, written into free slots) and leave as
soon as they finish: the last live rows move into the freed slots, so live rows always occupy
slots [0, n) and a decode step computes only live rows. Static scheduling fills the batch once
and lets it drain; continuous scheduling refills freed slots at once.
"""
from __future__ import annotations

import time

import torch

from engine.kv_cache import KVCache
from engine.outputs import BatchStats
from engine.sampler import SamplingTensors
from engine.sequence import Sequence
from engine.tokenizer import Tokenizer, find_stop

# Per-row tensors, all aligned with self.seqs (first dimension = rows).
ROW_TENSORS = ("prompt_lens", "max_tokens", "min_tokens", "steps", "lengths", "out", "stop_ids", "banned",
               "output_counts", "seen")


class Batch:
    """`rows_hint` slots are allocated on first use when the budget allows (continuous mode keeps
    room to refill); the cache grows or narrows only when admitted rows need it."""

    def __init__(self, tokenizer: Tokenizer, runner, max_batch_tokens: int, rows_hint: int = 1):
        self.tokenizer = tokenizer
        self.runner = runner
        self.device = runner.device
        self.vocab_size = runner.vocab_size
        self.max_batch_tokens = max_batch_tokens
        self.rows_hint = rows_hint
        self.cache: KVCache | None = None
        self.seqs: list[Sequence] = []
        self._widths: list[int] = []  # prompt + max_tokens of each row: the columns it may fill
        self.sampling: SamplingTensors | None = None
        for name in ROW_TENSORS:
            setattr(self, name, None)
        self.stats: BatchStats | None = None
        self.started = 0.0
        self._text_rows: list[int] = []
        self._logprob_rows: list[int] = []
        self._all: list[Sequence] = []  # every row that joined, for the statistics

    @property
    def num_rows(self) -> int:
        return len(self.seqs)

    @property
    def widest(self) -> int:
        """Columns the widest live row may fill (0 when empty)."""
        return max(self._widths, default=0)

    @property
    def empty(self) -> bool:
        return not self.seqs

    # -- joining ------------------------------------------------------------------------------

    def prefill_inputs(self, seqs: list[Sequence]) -> tuple[torch.Tensor, ...]:
        """Adds `seqs` as rows [n, n + k) and returns their prefill inputs:
        (input_ids, attention_mask, position_ids) each (k, P), right-padded, and last (k, 1): the
        column of each row's last prompt token, whose logits pick its first token."""
        n, k = self.num_rows, len(seqs)
        plen = max(s.num_prompt_tokens for s in seqs)
        self._reserve(n + k, max(self.widest, *(s.max_len for s in seqs)))
        if self.stats is None:
            self.stats = BatchStats(rows=0, max_prompt_len=0, max_new_tokens=0, reserved_tokens=0,
                                    prompt_tokens=0, padded_prompt_tokens=0)
            self.started = time.perf_counter()
        st = self.stats
        st.rows += k
        st.peak_rows = max(st.peak_rows, n + k)
        st.max_prompt_len = max(st.max_prompt_len, plen)
        st.max_new_tokens = max(st.max_new_tokens, *(s.params.max_tokens for s in seqs))
        st.reserved_tokens = max(st.reserved_tokens, self.cache.tokens)
        st.prompt_tokens += sum(s.num_prompt_tokens for s in seqs)
        st.padded_prompt_tokens += k * plen
        st.prefill_steps += 1
        self._all.extend(seqs)
        self._append_rows(seqs)
        lens = self.lengths[n:]  # a new row's cache holds its prompt
        ids = torch.full((k, plen), self.tokenizer.pad_token_id, dtype=torch.int64)
        for i, s in enumerate(seqs):
            ids[i, : s.num_prompt_tokens] = torch.tensor(s.prompt_token_ids)
        cols = torch.arange(plen, device=self.device)[None, :].repeat(k, 1)
        mask = (cols < lens[:, None]).long()
        self.cache.prefill(n)
        return ids.to(self.device), mask, cols, (lens - 1)[:, None]

    def _reserve(self, rows: int, width: int) -> None:
        """Makes room for `rows` rows of `width` columns, keeping the live rows."""
        cache = self.cache
        if cache is not None and cache.rows >= rows and cache.width >= width:
            return
        spare = max(rows, min(self.rows_hint, self.max_batch_tokens // width))
        if cache is None:
            self.cache = KVCache(self.runner.num_layers, spare, width)
        else:
            cache.resize(spare, width, keep_rows=self.num_rows, keep_width=int(self.lengths.max()) if self.seqs else 0)
            self.stats.resizes += 1

    def _append_rows(self, seqs: list[Sequence]) -> None:
        d = self.device

        def col(values, dtype=torch.int64):
            return torch.tensor(values, dtype=dtype, device=d)

        k = len(seqs)
        new = {
            "prompt_lens": col([s.num_prompt_tokens for s in seqs]),
            "max_tokens": col([s.params.max_tokens for s in seqs]),
            "min_tokens": col([s.params.min_tokens for s in seqs]),
            "steps": torch.zeros(k, dtype=torch.int64, device=d),
            "lengths": col([s.num_prompt_tokens for s in seqs]),  # cache columns filled, once prefilled
            "out": torch.full((k, max(s.params.max_tokens for s in seqs)), self.tokenizer.pad_token_id,
                              dtype=torch.int64, device=d),
            "stop_ids": self._stop_ids(seqs),
        }
        for name, value in new.items():
            old = getattr(self, name)
            setattr(self, name, value if old is None else _cat_padded(old, value, pad=-1 if name == "stop_ids"
                                                                     else self.tokenizer.pad_token_id))
        sampling = SamplingTensors.from_sequences(seqs, d)
        self.sampling = sampling if self.sampling is None else self.sampling.cat(sampling)
        self.seqs = self.seqs + list(seqs)
        self._widths += [s.max_len for s in seqs]
        self._sync_optional_state(seqs)

    def _sync_optional_state(self, new: list[Sequence]) -> None:
        """Penalty and min_tokens tables exist only while some row needs them."""
        n, k = self.num_rows, len(new)
        v = self.vocab_size
        if self.output_counts is not None or self.sampling.needs_penalties:
            if self.output_counts is None:
                self.output_counts = torch.zeros((n - k, v), dtype=torch.float32, device=self.device)
                self.seen = torch.zeros((n - k, v), dtype=torch.bool, device=self.device)
                for i, s in enumerate(self.seqs[: n - k]):  # rows already running: prompt + output so far
                    self.seen[i, torch.tensor(s.prompt_token_ids + self.out[i, : int(self.steps[i])].tolist(),
                                              device=self.device)] = True
                    self.output_counts[i].index_add_(0, self.out[i, : int(self.steps[i])],
                                                     torch.ones(int(self.steps[i]), device=self.device))
            seen = torch.zeros((k, v), dtype=torch.bool, device=self.device)
            for i, s in enumerate(new):
                seen[i, torch.tensor(s.prompt_token_ids, device=self.device)] = True
            self.output_counts = torch.cat([self.output_counts, torch.zeros((k, v), device=self.device)])
            self.seen = torch.cat([self.seen, seen])
        if bool((self.min_tokens > 0).any()):
            self.banned = self._banned_table(self.stop_ids)
        else:
            self.banned = None
        self._index_python_rows()

    def _index_python_rows(self) -> None:
        """Rows that need per-row Python work each step: stop strings, logprobs."""
        self._text_rows = [i for i, s in enumerate(self.seqs) if s.params.stop]
        self._logprob_rows = [i for i, s in enumerate(self.seqs) if s.params.logprobs is not None]

    # -- decoding -----------------------------------------------------------------------------

    def decode_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(last tokens (n, 1), attention_mask (n, width), positions (n, 1)): each row feeds its
        last token at its own length."""
        last = self.out.gather(1, (self.steps - 1)[:, None])
        width = int(self.lengths.max()) + 1
        mask = (torch.arange(width, device=self.device)[None, :] <= self.lengths[:, None]).long()
        self.cache.decode(self.lengths, width)
        self.stats.decode_steps += 1
        self.stats.computed_rows += self.num_rows
        return last, mask, self.lengths[:, None]

    def sampler_inputs(self, rows: slice) -> dict:
        """The sampler's per-row inputs for `rows`."""
        idx = torch.arange(self.num_rows, device=self.device)[rows]
        banned = None
        if self.banned is not None:
            banned = self.banned[rows] & (self.steps[rows] < self.min_tokens[rows])[:, None]
        return {"st": self.sampling.select(idx), "steps": self.steps[rows],
                "output_counts": None if self.output_counts is None else self.output_counts[rows],
                "seen": None if self.seen is None else self.seen[rows], "banned": banned}

    def record(self, rows: slice, tokens: torch.Tensor, logprobs: torch.Tensor | None) -> list[Sequence]:
        """Stores the new token of each row in `rows` (a prefill group, or all rows after a
        decode); finished rows leave the batch. Returns the sequences that finished."""
        now = time.perf_counter()
        idx = torch.arange(self.num_rows, device=self.device)[rows]
        if rows != slice(None):  # a prefill: these rows' first tokens
            for seq in self.seqs[rows]:
                seq.first_token_time = now
        self.out[idx, self.steps[idx]] = tokens
        self.steps[idx] += 1
        if rows == slice(None):
            self.lengths += 1  # the decoded token is now in the cache
        if self.output_counts is not None:
            self.output_counts[idx, tokens] += 1
            self.seen[idx, tokens] = True
        if logprobs is not None:
            self._record_logprobs(idx, tokens, logprobs)
        hit_stop_id = (tokens[:, None] == self.stop_ids[idx]).any(dim=1)
        hit_length = self.steps[idx] >= self.max_tokens[idx]
        first = idx[0].item() if len(idx) else 0
        stop_texts = self._check_stop_strings([i for i in self._text_rows if first <= i < first + len(idx)])
        stopped_by_id = set(idx[hit_stop_id].tolist())
        finished_rows = sorted(stopped_by_id | set(idx[hit_length].tolist()) | set(stop_texts))
        finished = []
        for i in finished_rows:
            seq = self.seqs[i]
            out = self.out[i, : int(self.steps[i])].tolist()
            seq.output_token_ids = out
            if i in stop_texts:
                at, stop = stop_texts[i]
                text = self.tokenizer.decode(out)
                seq.text = text[: at + len(stop)] if seq.params.include_stop_str_in_output else text[:at]
                seq.finish("stop", stop)
            elif i in stopped_by_id:
                last = out[-1]
                eos = last in self.tokenizer.eos_token_ids
                seq.text = self.tokenizer.decode(out if eos else out[:-1])
                seq.finish("stop", None if eos else last)
            else:
                seq.text = self.tokenizer.decode(out)
                seq.finish("length")
            seq.finish_time = now
            finished.append(seq)
        if finished_rows:
            self._remove(finished_rows)
        return finished

    def _remove(self, dead: list[int]) -> None:
        """Drops rows `dead`: live rows from the end move into the holes, so live rows stay [0, m)."""
        n = self.num_rows
        dead_set = set(dead)
        m = n - len(dead)
        holes = [i for i in dead if i < m]
        movers = [i for i in range(m, n) if i not in dead_set]
        order = list(range(m))
        for hole, mover in zip(holes, movers):
            order[hole] = mover
        self.cache.move_rows(movers, holes)
        keep = torch.tensor(order, dtype=torch.int64, device=self.device)
        for name in ROW_TENSORS:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.index_select(0, keep))
        self.sampling = self.sampling.select(keep)
        self.seqs = [self.seqs[i] for i in order]
        self._widths = [self._widths[i] for i in order]
        self._index_python_rows()
        self.stats.compactions += 1

    def finish_stats(self) -> BatchStats:
        """Closes the statistics of the rows that went through since the batch was last empty."""
        st = self.stats
        st.generated_tokens = sum(s.num_output_tokens for s in self._all)
        st.seconds = time.perf_counter() - self.started
        return st

    # -- helpers ------------------------------------------------------------------------------

    def _stop_ids(self, seqs: list[Sequence]) -> torch.Tensor:
        lists = [sorted(set(s.params.stop_token_ids)
                        | (set() if s.params.ignore_eos else set(self.tokenizer.eos_token_ids))) for s in seqs]
        width = max(1, max(len(ids) for ids in lists))
        table = torch.full((len(seqs), width), -1, dtype=torch.int64)
        for i, ids in enumerate(lists):
            table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        return table.to(self.device)

    def _banned_table(self, stop_ids: torch.Tensor) -> torch.Tensor:
        """(n, V) bool: each row's stop tokens (banned while it has fewer than min_tokens)."""
        v = self.vocab_size
        banned = torch.zeros((stop_ids.shape[0], v + 1), dtype=torch.bool, device=self.device)
        banned.scatter_(1, torch.where(stop_ids >= 0, stop_ids, v).clamp(max=v), True)  # -1 -> the spare column
        return banned[:, :v].contiguous()

    def _check_stop_strings(self, rows: list[int]) -> dict[int, tuple[int, str]]:
        """Rows whose text now holds one of their stop strings: {row: (char index, stop)}."""
        hits = {}
        for i in rows:
            text = self.tokenizer.decode(self.out[i, : int(self.steps[i])].tolist())
            hit = find_stop(text, self.seqs[i].params.stop)
            if hit is not None:
                hits[i] = hit
        return hits

    def _record_logprobs(self, idx: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        first = int(idx[0]) if len(idx) else 0
        for i in self._logprob_rows:
            j = i - first
            if not 0 <= j < len(idx):
                continue
            seq = self.seqs[i]
            tok = int(tokens[j])
            entry = {tok: float(logprobs[j, tok])}
            if seq.params.logprobs:
                top = logprobs[j].topk(seq.params.logprobs)
                entry.update(zip(top.indices.tolist(), top.values.tolist()))
            seq.logprobs = (seq.logprobs or []) + [entry]


def _cat_padded(a: torch.Tensor, b: torch.Tensor, pad: int) -> torch.Tensor:
    """Rows of a then b; 2-D tensors are right-padded with `pad` to the wider of the two."""
    if a.dim() == 2 and a.shape[1] != b.shape[1]:
        w = max(a.shape[1], b.shape[1])
        a = torch.nn.functional.pad(a, (0, w - a.shape[1]), value=pad)
        b = torch.nn.functional.pad(b, (0, w - b.shape[1]), value=pad)
    return torch.cat([a, b])
