"""The running rows' table: their sampling state as device tensors, one row per table slot.

A request joins the table when it is admitted (before its first prefill chunk) and leaves when
it finishes or is preempted: the last rows move into the freed slots, so live rows always
occupy [0, n). Every per-row value the sampler needs (steps, limits, stop ids, sampling
settings, penalty counts) lives in a tensor with one row per slot, updated in place; the host
learns each step's tokens and finish flags through one transfer and appends the tokens to
the rows' outputs. Per-row work beyond that runs only for rows that finish, have stop
strings or want logprobs.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import numpy as np
import torch

from engine.api.errors import BatchFull
from engine.core.sequence import Sequence
from engine.models.tokenizer import StopStringChecker, Tokenizer
from engine.sample.finish import finish_rows, stop_string_hits
from engine.sample.logprobs import logprob_columns, append_logprobs, top_n
from engine.sample.sampler import SamplingFlags, SamplingTensors
from engine.sample.token_options import bias_rows, dynamic_bans, has_bias, indexes_on


@dataclass
class Sampled:
    """What a pass sampled, handed from run to postprocess."""

    seqs: list[Sequence]
    """The rows that sampled a token (prefill chunks mid-prompt sample none)."""
    rows: slice | torch.Tensor
    """Their table slots (a slice, or an index tensor)."""
    tokens: torch.Tensor
    """(k,) int64 on the device: each row's new token."""
    logprobs: torch.Tensor | None
    """(k, V) float32 on the device when some row wants logprobs."""


def sample_seed(seed: int, j: int) -> int:
    """Sample j's seed: sample 0 keeps the request's, so it equals the n = 1 output."""
    if j == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"{seed}:{j}".encode()).digest()[:8], "big") >> 1


# Device tensors with one row per slot (first dimension = slots). `state` packs the integer
# per-row values (STATE_COLUMNS), so joining or moving rows copies one table.
ROW_TENSORS = ("state", "stop_ids", "output_counts", "seen", "banned", "bias")
STATE_COLUMNS = ("steps", "max_tokens", "min_tokens")
HOST_ARRAYS = ("h_steps", "h_min", "h_text")
FEATURES = ("greedy", "min_p", "top_k", "top_p", "penalties", "logprobs", "min_tokens", "bias", "bad_words")

Rows = "slice | torch.Tensor"


class RunningRows:
    """Live rows are slots [0, num_rows) of a table of max_num_seqs slots."""

    def __init__(self, tokenizer: Tokenizer, device: torch.device, vocab_size: int, slots: int):
        self.tokenizer = tokenizer
        self.device = device
        self.vocab_size = vocab_size
        self.slots = slots
        self.seqs: list[Sequence] = []
        self.row_of: dict[int, int] = {}  # id(seq) -> its slot
        self.state = torch.zeros((slots, len(STATE_COLUMNS)), dtype=torch.int64, device=device)
        for i, name in enumerate(STATE_COLUMNS):  # column views: they follow the table's rows
            setattr(self, name, self.state[:, i])
        self.stop_ids = torch.full((slots, 1), -1, dtype=torch.int64, device=device)
        self.output_counts = self.seen = self.banned = self.bias = None
        self.sampling = SamplingTensors.empty(slots, device)
        self.h_steps = np.zeros(slots, dtype=np.int64)  # host mirror of `steps`
        self.h_min = np.zeros(slots, dtype=np.int64)  # min_tokens of each row
        self.h_text = np.zeros(slots, dtype=bool)  # rows with stop strings
        self._features = dict.fromkeys(FEATURES, 0)  # rows using each sampling feature
        self.flags = SamplingFlags()

    @property
    def num_rows(self) -> int:
        return len(self.seqs)

    @property
    def empty(self) -> bool:
        return not self.seqs

    def rows(self, seqs: list[Sequence]) -> "Rows":
        """Table slots of `seqs`: a slice when they are exactly [0, k) in order (no gather)."""
        idx = [self.row_of[id(s)] for s in seqs]
        if idx == list(range(len(idx))):
            return slice(0, len(idx))
        return torch.tensor(idx, dtype=torch.int64, device=self.device)

    # -- joining ------------------------------------------------------------------------------

    def join(self, seqs: list[Sequence]) -> None:
        """Adds `seqs` as rows [n, n + k); a row back from a preemption resumes its counters."""
        n, k = self.num_rows, len(seqs)
        if n + k > self.slots:
            raise BatchFull(f"{n + k} rows do not fit the table's {self.slots} slots")
        rows = slice(n, n + k)
        steps = [s.num_output_tokens for s in seqs]
        state = torch.tensor([[st, s.params.max_tokens, s.params.min_tokens] for st, s in zip(steps, seqs)],
                             dtype=torch.int64)
        self.state[rows] = state.to(self.device)
        self._write_stop_ids(rows, seqs)
        self.sampling.write(n, SamplingTensors.from_sequences(seqs, self.device))
        self.h_steps[rows] = steps
        self.h_min[rows] = [s.params.min_tokens for s in seqs]
        self.h_text[rows] = [bool(s.params.stop) for s in seqs]
        for i, s in enumerate(seqs):
            if s.params.stop and s.stop_checker is None:
                enders = self.tokenizer.stop_enders(s.params.stop, self.vocab_size)
                s.stop_checker = StopStringChecker(s.params.stop, enders)
            self.row_of[id(s)] = n + i
        self.seqs = self.seqs + list(seqs)
        self._count_features(seqs, +1)
        self._write_optional_state(rows, seqs)

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
        need no history in them: their neutral settings make their counts irrelevant. A row back
        from a preemption gets its counts from its output so far."""
        v = self.vocab_size
        if self.flags.penalties:
            if self.output_counts is None:
                self.output_counts = torch.zeros((self.slots, v), dtype=torch.float32, device=self.device)
                self.seen = torch.zeros((self.slots, v), dtype=torch.bool, device=self.device)
            counts = torch.zeros((len(seqs), v), dtype=torch.float32)
            seen = torch.zeros((len(seqs), v), dtype=torch.bool)
            for i, s in enumerate(seqs):
                seen[i, torch.tensor(s.token_ids)] = True
                if s.output_token_ids:
                    counts[i].index_add_(0, torch.tensor(s.output_token_ids), torch.ones(s.num_output_tokens))
            self.output_counts[rows] = counts.to(self.device)
            self.seen[rows] = seen.to(self.device)
        if self.flags.min_tokens:
            if self.banned is None:
                self.banned = torch.zeros((self.slots, v), dtype=torch.bool, device=self.device)
            stop = self.stop_ids[rows]
            banned = torch.zeros((len(seqs), v + 1), dtype=torch.bool, device=self.device)
            banned.scatter_(1, torch.where(stop >= 0, stop, v).clamp(max=v), True)  # -1 -> the spare column
            self.banned[rows] = banned[:, :v]
        if self.flags.bias or self.bias is not None:  # a slot's earlier row may have left its bias there
            if self.bias is None:
                self.bias = torch.zeros((self.slots, v), dtype=torch.float32, device=self.device)
            self.bias[rows] = bias_rows(seqs, v).to(self.device)

    def _count_features(self, seqs: list[Sequence], sign: int) -> None:
        for s in seqs:
            for name in _features(s):
                self._features[name] += sign
        f, n = self._features, self.num_rows
        self.flags = SamplingFlags(all_greedy=f["greedy"] == n, min_p=f["min_p"] > 0, top_k=f["top_k"] > 0,
                                   top_p=f["top_p"] > 0, penalties=f["penalties"] > 0,
                                   logprobs=f["logprobs"] > 0, min_tokens=f["min_tokens"] > 0, bias=f["bias"] > 0,
                                   bad_words=f["bad_words"] > 0)

    # -- sampling and recording ---------------------------------------------------------------

    def sampler_inputs(self, rows: "Rows", seqs: list[Sequence] | None = None) -> dict:
        """The sampler's per-row inputs for `rows` (views for a slice); `seqs`, the rows'
        sequences, for the bans of bad words of several tokens."""
        banned = None
        if self.banned is not None and self.flags.min_tokens:
            banned = self.banned[rows] & (self.steps[rows] < self.min_tokens[rows])[:, None]
        penalties = self.flags.penalties
        st = self.sampling.rows(rows) if isinstance(rows, slice) else self.sampling.select(rows)
        ban = None
        if self.flags.bad_words and seqs is not None:
            at, tokens = dynamic_bans(seqs)
            if at:
                pair = indexes_on([at, tokens], self.device)
                ban = (pair[0], pair[1])
        return {"st": st, "flags": self.flags, "steps": self.steps[rows],
                "output_counts": self.output_counts[rows] if penalties else None,
                "seen": self.seen[rows] if penalties else None, "banned": banned,
                "bias": self.bias[rows] if self.flags.bias else None, "ban": ban}

    def append_tokens(self, seqs: list[Sequence], rows: "Rows", tokens: torch.Tensor,
                      logprobs: torch.Tensor | None) -> list[Sequence]:
        """Stores each sampled row's new token, on the device and (through one transfer) on the
        host. Returns the sequences that finished (still in the table: see `remove`)."""
        self.steps[rows] += 1
        if self.flags.penalties:
            idx = torch.arange(rows.start, rows.stop, device=self.device) if isinstance(rows, slice) else rows
            self.output_counts[idx, tokens] += 1
            self.seen[idx, tokens] = True
        done = (tokens[:, None] == self.stop_ids[rows]).any(dim=1) | (self.steps[rows] >= self.max_tokens[rows])
        n = top_n(seqs)
        rows_out = [tokens.double(), done.double()]
        if logprobs is not None and n is not None:  # logprobs ride along in the same transfer
            rows_out += logprob_columns(logprobs, tokens, n)
        host = torch.stack(rows_out).cpu().numpy()  # the step's one device->host transfer
        now = time.perf_counter()
        slots = np.arange(rows.start, rows.stop) if isinstance(rows, slice) else np.array(
            [self.row_of[id(s)] for s in seqs])
        self.h_steps[slots] += 1
        new = host[0].astype(np.int64).tolist()
        for seq, tok in zip(seqs, new):
            if not seq.output_token_ids and seq.first_token_time is None:
                seq.first_token_time = now
            seq.output_token_ids.append(tok)
        if len(host) > 2:
            append_logprobs(seqs, host[2:], n)
        finished = set(np.flatnonzero(host[1]).tolist())
        text = self.h_text[slots]
        if text.any():
            # rows with stop strings past min_tokens whose new token can end one
            due = np.flatnonzero(text & (self.h_steps[slots] >= self.h_min[slots])).tolist()
            finished |= stop_string_hits(self.tokenizer, [(i, seqs[i]) for i in due
                                                          if seqs[i].stop_checker.may_stop(new[i])])
        if not finished:
            return []
        done_seqs = [seqs[i] for i in sorted(finished)]
        finish_rows(self.tokenizer, done_seqs, now)
        return done_seqs

    # -- leaving ------------------------------------------------------------------------------

    def remove(self, gone: list[Sequence]) -> None:
        """Drops rows `gone`: live rows from the end move into the holes, so live rows stay [0, m)."""
        if not gone:
            return
        dead = sorted(self.row_of.pop(id(s)) for s in gone)
        n = self.num_rows
        dead_set = set(dead)
        m = n - len(dead)
        holes = [i for i in dead if i < m]
        movers = [i for i in range(m, n) if i not in dead_set]
        if holes:
            src = torch.tensor(movers, device=self.device)
            dst = torch.tensor(holes, device=self.device)
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
        for i, s in enumerate(self.seqs):
            self.row_of[id(s)] = i
        self._count_features(gone, -1)


def _features(seq: Sequence) -> list[str]:
    p = seq.params
    flags = {"greedy": p.temperature == 0, "min_p": p.min_p > 0, "top_k": p.top_k > 0, "top_p": p.top_p < 1,
             "penalties": p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0,
             "logprobs": p.logprobs is not None, "min_tokens": p.min_tokens > 0, "bias": has_bias(seq),
             "bad_words": any(len(w) > 1 for w in seq.bad_words)}
    return [name for name, on in flags.items() if on]
