"""The running batch: its rows' state as device tensors in the KV pool's slot order.

Rows join through a prefill into free slots [n, n + k) and leave as soon as they finish: the
last live rows move into the freed slots, so live rows always occupy slots [0, n) and a decode
step computes only live rows. Every per-row value the device needs (last token, length, steps,
limits, stop ids, sampling settings, penalty counts) lives in a tensor with one row per slot,
updated in place; the host keeps numpy mirrors of what its bookkeeping needs (lengths, steps,
output tokens), fed by one transfer per step: the sampled tokens and the finish flags.
Per-row Python runs only for rows that finish, have stop strings or want logprobs.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from engine.kv_cache import KVCache
from engine.outputs import BatchStats
from engine.sampler import SamplingFlags, SamplingTensors
from engine.sequence import Sequence
from engine.tokenizer import StopStringChecker, Tokenizer, find_stop

# Device tensors with one row per slot (first dimension = slots). `state` packs the integer
# per-row values (STATE_COLUMNS), so joining, moving or resizing rows copies one table.
ROW_TENSORS = ("state", "stop_ids", "output_counts", "seen", "banned")
STATE_COLUMNS = ("last", "lengths", "steps", "max_tokens", "min_tokens")
HOST_ARRAYS = ("h_lengths", "h_steps", "h_max_len", "h_text", "out")
FEATURES = ("greedy", "min_p", "top_k", "top_p", "penalties", "logprobs", "min_tokens")


class Batch:
    """Live rows are slots [0, num_rows) of the KV pool's layout."""

    def __init__(self, tokenizer: Tokenizer, device: torch.device, vocab_size: int, cache: KVCache):
        self.tokenizer = tokenizer
        self.device = device
        self.vocab_size = vocab_size
        self.cache = cache
        self.seqs: list[Sequence] = []
        self.slots = 0
        for name in ROW_TENSORS:
            setattr(self, name, None)
        self.sampling: SamplingTensors | None = None
        self.h_lengths = np.zeros(0, dtype=np.int64)  # host mirror of `lengths`
        self.h_steps = np.zeros(0, dtype=np.int64)  # host mirror of `steps`
        self.h_max_len = np.zeros(0, dtype=np.int64)  # prompt + max_tokens of each row
        self.h_text = np.zeros(0, dtype=bool)  # rows with stop strings
        self.out = np.zeros((0, 1), dtype=np.int64)  # (slots, widest max_tokens): output tokens
        self._features = dict.fromkeys(FEATURES, 0)  # rows using each sampling feature
        self.flags = SamplingFlags()
        self.stats: BatchStats | None = None
        self.started = 0.0
        self._all: list[Sequence] = []

    @property
    def num_rows(self) -> int:
        return len(self.seqs)

    @property
    def widest(self) -> int:
        """Columns the widest live row may fill (0 when empty)."""
        return int(self.h_max_len[: self.num_rows].max()) if self.seqs else 0

    @property
    def empty(self) -> bool:
        return not self.seqs

    def max_length(self) -> int:
        """Cache columns the longest live row has filled (known on the host: no sync)."""
        return int(self.h_lengths[: self.num_rows].max()) if self.seqs else 0

    # -- layout -------------------------------------------------------------------------------

    def set_layout(self, slots: int, width: int) -> None:
        """Lays the KV pool out as `slots` x `width`, keeping the live rows and their state."""
        n = self.num_rows
        self.cache.set_layout(slots, width, keep_rows=n, keep_width=self.max_length(), device=self.device)
        if slots == self.slots:
            return
        if self.state is None:
            self.state = torch.zeros((0, len(STATE_COLUMNS)), dtype=torch.int64, device=self.device)
            self.stop_ids = torch.full((0, 1), -1, dtype=torch.int64, device=self.device)
        for name in ROW_TENSORS + HOST_ARRAYS:
            old = getattr(self, name)
            if old is not None:
                setattr(self, name, _resized(old, slots, n))
        for i, name in enumerate(STATE_COLUMNS):  # column views: they follow the table's rows
            setattr(self, name, self.state[:, i])
        self.sampling = _resized_sampling(self.sampling, slots, n, self.device)
        self.slots = slots

    # -- joining ------------------------------------------------------------------------------

    def join(self, seqs: list[Sequence], offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Adds `seqs` as rows [n, n + k). Returns their prefill inputs: input_ids (k, P), each
        prompt from token `offset` on (the tokens before it come from the prefix cache),
        right-padded, and lengths (k,) (each row's whole prompt length)."""
        n, k = self.num_rows, len(seqs)
        if n + k > self.slots:
            raise RuntimeError(f"{n + k} rows do not fit the KV layout's {self.slots} slots")
        self._start_stats(seqs, offset)
        rows = slice(n, n + k)
        plens = [s.num_prompt_tokens for s in seqs]
        ids = torch.full((k, max(plens) - offset), self.tokenizer.pad_token_id, dtype=torch.int64)
        for i, s in enumerate(seqs):
            ids[i, : plens[i] - offset] = torch.tensor(s.prompt_token_ids[offset:])
        # one host->device copy for the integer row state (columns as STATE_COLUMNS)
        state = torch.tensor([[0, p, 0, s.params.max_tokens, s.params.min_tokens] for p, s in zip(plens, seqs)],
                             dtype=torch.int64).to(self.device)
        self.state[rows] = state
        self._write_stop_ids(rows, seqs)
        self.sampling.write(n, SamplingTensors.from_sequences(seqs, self.device))
        self.h_lengths[rows] = plens
        self.h_steps[rows] = 0
        self.h_max_len[rows] = [s.max_len for s in seqs]
        self.h_text[rows] = [bool(s.params.stop) for s in seqs]
        widest_out = max(s.params.max_tokens for s in seqs)
        if widest_out > self.out.shape[1]:
            self.out = np.pad(self.out, ((0, 0), (0, widest_out - self.out.shape[1])))
        for s in seqs:
            if s.params.stop:
                s.stop_checker = StopStringChecker(s.params.stop)
        self.seqs = self.seqs + list(seqs)
        self._count_features(seqs, +1)
        self._write_optional_state(rows, seqs)
        return ids.to(self.device), state[:, 1]

    def _write_stop_ids(self, rows: slice, seqs: list[Sequence]) -> None:
        eos = set(self.tokenizer.eos_token_ids)
        lists = [sorted(set(s.params.stop_token_ids) | (set() if s.params.ignore_eos else eos)) for s in seqs]
        width = max(1, max(len(ids) for ids in lists))
        if width > self.stop_ids.shape[1]:
            self.stop_ids = torch.nn.functional.pad(self.stop_ids, (0, width - self.stop_ids.shape[1]), value=-1)
        table = torch.full((len(seqs), self.stop_ids.shape[1]), -1, dtype=torch.int64)
        for i, ids in enumerate(lists):
            table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        self.stop_ids[rows] = table.to(self.device)

    def _write_optional_state(self, rows: slice, seqs: list[Sequence]) -> None:
        """Penalty and min_tokens tables exist once some row needs them. Rows that joined before
        need no history in them: their neutral settings make their counts irrelevant."""
        v = self.vocab_size
        if self.flags.penalties:
            if self.output_counts is None:
                self.output_counts = torch.zeros((self.slots, v), dtype=torch.float32, device=self.device)
                self.seen = torch.zeros((self.slots, v), dtype=torch.bool, device=self.device)
            self.output_counts[rows] = 0
            seen = torch.zeros((len(seqs), v), dtype=torch.bool)
            for i, s in enumerate(seqs):
                seen[i, torch.tensor(s.prompt_token_ids)] = True
            self.seen[rows] = seen.to(self.device)
        if self.flags.min_tokens:
            if self.banned is None:
                self.banned = torch.zeros((self.slots, v), dtype=torch.bool, device=self.device)
            stop = self.stop_ids[rows]
            banned = torch.zeros((len(seqs), v + 1), dtype=torch.bool, device=self.device)
            banned.scatter_(1, torch.where(stop >= 0, stop, v).clamp(max=v), True)  # -1 -> the spare column
            self.banned[rows] = banned[:, :v]

    def _count_features(self, seqs: list[Sequence], sign: int) -> None:
        for s in seqs:
            for name in _features(s):
                self._features[name] += sign
        f, n = self._features, self.num_rows
        self.flags = SamplingFlags(all_greedy=f["greedy"] == n, min_p=f["min_p"] > 0, top_k=f["top_k"] > 0,
                                   top_p=f["top_p"] > 0, penalties=f["penalties"] > 0,
                                   logprobs=f["logprobs"] > 0, min_tokens=f["min_tokens"] > 0)

    # -- sampling and recording ---------------------------------------------------------------

    def sampler_inputs(self, rows: slice) -> dict:
        """The sampler's per-row inputs for `rows` (views: no copies)."""
        banned = None
        if self.banned is not None and self.flags.min_tokens:
            banned = self.banned[rows] & (self.steps[rows] < self.min_tokens[rows])[:, None]
        penalties = self.flags.penalties
        return {"st": self.sampling.rows(rows), "flags": self.flags, "steps": self.steps[rows],
                "output_counts": self.output_counts[rows] if penalties else None,
                "seen": self.seen[rows] if penalties else None, "banned": banned}

    def record(self, rows: slice, tokens: torch.Tensor, logprobs: torch.Tensor | None,
               decode: bool) -> list[Sequence]:
        """Stores each row's new token, on the device and (through one transfer) on the host;
        finished rows leave the batch. Returns the sequences that finished."""
        a, b = rows.start, rows.stop
        self.last[rows] = tokens
        self.steps[rows] += 1
        if decode:
            self.lengths[rows] += 1  # the token fed this step is now in the cache
        if self.flags.penalties:
            idx = torch.arange(a, b, device=self.device)
            self.output_counts[idx, tokens] += 1
            self.seen[idx, tokens] = True
        done = (tokens[:, None] == self.stop_ids[rows]).any(dim=1) | (self.steps[rows] >= self.max_tokens[rows])
        host = torch.stack([tokens, done.long()]).cpu().numpy()  # the step's one device->host transfer
        now = time.perf_counter()
        self.out[np.arange(a, b), self.h_steps[a:b]] = host[0]
        self.h_steps[a:b] += 1
        if decode:
            self.h_lengths[a:b] += 1
        else:
            for seq in self.seqs[a:b]:
                seq.first_token_time = now
        if logprobs is not None:
            self._record_logprobs(a, b, tokens, logprobs)
        finished = set((np.flatnonzero(host[1]) + a).tolist())
        if self.h_text[a:b].any():
            finished |= self._stop_string_hits((np.flatnonzero(self.h_text[a:b]) + a).tolist())
        if not finished:
            return []
        rows_done = sorted(finished)
        seqs = self._finish(rows_done, now)
        self._remove(rows_done)
        return seqs

    def _stop_string_hits(self, rows: list[int]) -> set[int]:
        """Rows whose latest tokens complete one of their stop strings (one decode call for all)."""
        checkers = [self.seqs[i].stop_checker for i in rows]
        windows = [self.out[i, max(0, self.h_steps[i] - c.window): self.h_steps[i]].tolist()
                   for i, c in zip(rows, checkers)]
        texts = self.tokenizer.decode_windows(windows)
        return {i for i, c, text in zip(rows, checkers, texts) if c.found(text)}

    def _finish(self, rows: list[int], now: float) -> list[Sequence]:
        """Finish reason and text of each finished row; their texts decoded in one call."""
        seqs = [self.seqs[i] for i in rows]
        outs = [self.out[i, : self.h_steps[i]].tolist() for i in rows]
        # a stop token that is not EOS stays in token_ids but not in the text
        keep_last = [not _is_stop_id(self, s, out[-1]) or (out[-1] in self.tokenizer.eos_token_ids
                                                           and not s.params.ignore_eos)
                     for s, out in zip(seqs, outs)]
        texts = self.tokenizer.decode_batch([out if keep else out[:-1] for out, keep in zip(outs, keep_last)])
        for seq, out, keep, text in zip(seqs, outs, keep_last, texts):
            seq.output_token_ids = out
            hit = find_stop(text, seq.params.stop) if seq.params.stop else None
            if hit is not None:
                if not keep:  # the stop string counts from the whole output
                    text = self.tokenizer.decode(out)
                    hit = find_stop(text, seq.params.stop) or hit
                at, stop = hit
                seq.text = text[: at + len(stop)] if seq.params.include_stop_str_in_output else text[:at]
                seq.finish("stop", stop)
            elif _is_stop_id(self, seq, out[-1]):
                seq.text = text
                seq.finish("stop", None if keep else out[-1])
            else:
                seq.text = text
                seq.finish("length")
            seq.stop_checker = None
            seq.finish_time = now
        return seqs

    def _record_logprobs(self, a: int, b: int, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Rows that asked for logprobs: the chosen token's and the top-N (an opt-in extra transfer)."""
        rows = [i for i in range(a, b) if self.seqs[i].params.logprobs is not None]
        if not rows:  # rows elsewhere in the batch want them, none of these
            return
        top_n = max(self.seqs[i].params.logprobs for i in rows)
        local = torch.tensor([i - a for i in rows], device=logprobs.device)
        chosen = logprobs[local].gather(1, tokens[local][:, None])[:, 0].tolist()
        top = logprobs[local].topk(max(top_n, 1)) if top_n else None
        top_ids, top_vals = (top.indices.tolist(), top.values.tolist()) if top is not None else ([], [])
        for j, i in enumerate(rows):
            seq = self.seqs[i]
            n = seq.params.logprobs
            entry = {int(self.out[i, self.h_steps[i] - 1]): chosen[j]}
            if n:
                entry.update(zip(top_ids[j][:n], top_vals[j][:n]))
            seq.logprobs = (seq.logprobs or []) + [entry]

    # -- leaving ------------------------------------------------------------------------------

    def _remove(self, dead: list[int]) -> None:
        """Drops rows `dead`: live rows from the end move into the holes, so live rows stay [0, m)."""
        n = self.num_rows
        dead_set = set(dead)
        m = n - len(dead)
        holes = [i for i in dead if i < m]
        movers = [i for i in range(m, n) if i not in dead_set]
        gone = [self.seqs[i] for i in dead]
        if holes:
            src = torch.tensor(movers, device=self.device)
            dst = torch.tensor(holes, device=self.device)
            self.cache.move_rows(src, dst)
            for name in ROW_TENSORS:
                t = getattr(self, name)
                if t is not None:
                    t[dst] = t[src]
            self.sampling.move(src, dst)
            for name in HOST_ARRAYS:
                arr = getattr(self, name)
                arr[holes] = arr[movers]
        order = list(range(m))
        for hole, mover in zip(holes, movers):
            order[hole] = mover
        self.seqs = [self.seqs[i] for i in order]
        self._count_features(gone, -1)
        self.stats.compactions += 1

    # -- statistics ---------------------------------------------------------------------------

    def _start_stats(self, seqs: list[Sequence], offset: int) -> None:
        if self.stats is None:
            self.stats = BatchStats(rows=0, max_prompt_len=0, max_new_tokens=0, reserved_tokens=0,
                                    prompt_tokens=0, padded_prompt_tokens=0)
            self.started = time.perf_counter()
            self._all = []
        st, k = self.stats, len(seqs)
        plen = max(s.num_prompt_tokens for s in seqs)
        st.rows += k
        st.peak_rows = max(st.peak_rows, self.num_rows + k)
        st.max_prompt_len = max(st.max_prompt_len, plen)
        st.max_new_tokens = max(st.max_new_tokens, *(s.params.max_tokens for s in seqs))
        st.reserved_tokens = max(st.reserved_tokens, (self.num_rows + k) * max(self.widest, *(s.max_len for s in seqs)))
        st.prompt_tokens += sum(s.num_prompt_tokens for s in seqs)
        st.padded_prompt_tokens += k * (plen - offset)
        st.cached_prompt_tokens += k * offset
        st.prefill_steps += 1
        self._all.extend(seqs)

    def count_decode(self) -> None:
        self.stats.decode_steps += 1
        self.stats.computed_rows += self.num_rows

    def finish_stats(self) -> BatchStats:
        """Closes the statistics of the rows that went through since the batch was last empty."""
        st, self.stats = self.stats, None
        st.generated_tokens = sum(s.num_output_tokens for s in self._all)
        st.seconds = time.perf_counter() - self.started
        return st


def _features(seq: Sequence) -> list[str]:
    p = seq.params
    flags = {"greedy": p.temperature == 0, "min_p": p.min_p > 0, "top_k": p.top_k > 0, "top_p": p.top_p < 1,
             "penalties": p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0,
             "logprobs": p.logprobs is not None, "min_tokens": p.min_tokens > 0}
    return [name for name, on in flags.items() if on]


def _is_stop_id(batch: Batch, seq: Sequence, token: int) -> bool:
    return token in seq.params.stop_token_ids or (token in batch.tokenizer.eos_token_ids and not seq.params.ignore_eos)


def _resized(old, slots: int, keep: int):
    """`old` (a tensor or numpy array, rows first) with `slots` rows, its first `keep` kept."""
    if isinstance(old, np.ndarray):
        new = np.zeros((slots, *old.shape[1:]), dtype=old.dtype)
        keep = min(keep, len(old))
    else:
        fill = -1 if old.dtype == torch.int64 and old.dim() == 2 else 0  # stop_ids: -1 = no id
        new = old.new_full((slots, *old.shape[1:]), fill)
    new[:keep] = old[:keep]
    return new


def _resized_sampling(old: SamplingTensors | None, slots: int, keep: int, device) -> SamplingTensors:
    new = SamplingTensors.empty(slots, device)
    if old is not None and keep:
        new.write(0, old.rows(slice(0, keep)))
    return new
