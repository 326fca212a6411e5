"""Decoder LMs' hidden states (Qwen3-Embedding, gte-Qwen2, e5-mistral, decoder classifiers)
through the paged engine's prefill: rows go into blocks of the KV pool in passes of at most
max_num_batched_tokens (a long row over several passes reads its earlier chunks' keys and
values from its blocks), are pooled as their chunks pass, and give their blocks back at once:
no KV is kept after the pass and nothing is named in the prefix cache."""
from __future__ import annotations

import torch

from engine.api.sampling_params import SamplingParams
from engine.core.paged import PagedPass
from engine.core.scheduler import ScheduledChunk
from engine.core.sequence import Sequence

PARAMS = SamplingParams(max_tokens=1)


def pooled_states(paged: PagedPass, rows: list[list[int]], kind: str) -> torch.Tensor:
    """(R, H) float32: each row's token states pooled (MEAN, CLS, LAST or MAX). Rows are run in
    groups whose blocks fit the pool's free blocks; every row fits the pool (checked by the caller)."""
    pool = paged.pool
    out: list[torch.Tensor | None] = [None] * len(rows)
    group: list[int] = []
    used = 0
    for i in list(range(len(rows))) + [None]:
        need = -(-len(rows[i]) // pool.block_size) if i is not None else 0
        if group and (i is None or used + need > pool.num_free):
            for j, vec in zip(group, _group(paged, [rows[j] for j in group], kind)):
                out[j] = vec
            group, used = [], 0
        if i is not None:
            group.append(i)
            used += need
    return torch.stack(out) if out else torch.empty(0)


@torch.inference_mode()
def _group(paged: PagedPass, rows: list[list[int]], kind: str) -> list[torch.Tensor]:
    pool = paged.pool
    seqs = [paged.stamp(Sequence(index=i, prompt_token_ids=r, params=PARAMS, seed=0)) for i, r in enumerate(rows)]
    acc: list[torch.Tensor | None] = [None] * len(rows)
    try:
        for seq in seqs:
            seq.block_ids = pool.table([], seq.num_prompt_tokens)
            seq.num_computed_tokens = 0
        pending = list(range(len(seqs)))
        while pending:
            chunks, budget = [], paged.max_num_batched_tokens
            for r in pending:
                if budget <= 0:
                    break
                seq = seqs[r]
                n = min(seq.num_prompt_tokens - seq.num_computed_tokens, budget)
                chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
                budget -= n
            states = paged.runner.hidden_states(paged.cache, chunks)
            t = 0
            for c in chunks:
                part = states[t:t + c.count]
                t += c.count
                acc[c.seq.index] = _accumulate(acc[c.seq.index], part, kind, first=c.start == 0, last=c.samples)
                c.seq.num_computed_tokens += c.count
            pending = [r for r in pending if seqs[r].num_computed_tokens < seqs[r].num_prompt_tokens]
    finally:
        for seq in seqs:
            pool.release(seq.block_ids)
            seq.block_ids = []
    if kind == "MEAN":
        return [a / len(r) for a, r in zip(acc, rows)]
    return acc


def _accumulate(acc, part: torch.Tensor, kind: str, first: bool, last: bool):
    if kind == "LAST":
        return part[-1] if last else acc
    if kind == "CLS":
        return part[0] if first else acc
    if kind == "MEAN":
        s = part.sum(0)
        return s if acc is None else acc + s
    m = part.max(0).values
    return m if acc is None else torch.maximum(acc, m)
