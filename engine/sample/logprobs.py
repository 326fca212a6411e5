"""Logprobs of sampled tokens: packed into the step's one device->host transfer, then unpacked
into each row's {token id: logprob} entries (the chosen token's first, then its top-N) and the
chosen token's rank in the whole vocabulary (vLLM's Logprob.rank)."""
from __future__ import annotations

import numpy as np
import torch

from engine.core.sequence import Sequence


def top_n(seqs: list[Sequence]) -> int | None:
    """The most logprobs any of `seqs` asks for (None: none asks)."""
    return max((s.params.logprobs for s in seqs if s.params.logprobs is not None), default=None)


def logprob_columns(logprobs: torch.Tensor, tokens: torch.Tensor, n: int) -> list[torch.Tensor]:
    """What rides along in the transfer for logprobs (k, V) and sampled tokens (k,): the chosen
    tokens' logprobs and ranks (1 + the tokens more probable), then n rows of top values and n of
    their token ids (all float64, (k,))."""
    chosen = logprobs.gather(1, tokens[:, None])
    columns = [chosen[:, 0].double(), (logprobs > chosen).sum(1).double() + 1]
    if n:
        top = logprobs.topk(n)
        columns += [*top.values.double().T, *top.indices.double().T]
    return columns


def append_logprobs(seqs: list[Sequence], host: np.ndarray, n: int) -> None:
    """Appends each row's entry for its newest token, and that token's rank, from the transfer's
    logprob rows (`host`: chosen, its rank, then n top values, then n top token ids, one column
    per row of `seqs`)."""
    chosen, ranks, values, ids = host[0], host[1].astype(np.int64), host[2:2 + n], host[2 + n:].astype(np.int64)
    for i, seq in enumerate(seqs):
        want = seq.params.logprobs
        if want is None:
            continue
        entry = {seq.output_token_ids[-1]: float(chosen[i])}
        entry.update(zip(ids[:want, i].tolist(), values[:want, i].tolist()))
        if seq.logprobs is None:  # (a list of its own per sequence: appended in place, not copied per step)
            seq.logprobs, seq.logprob_ranks = [], []
        seq.logprobs.append(entry)
        seq.logprob_ranks.append(int(ranks[i]))
