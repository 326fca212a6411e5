"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`): the log-probability of each prompt
token given the tokens before it, and of its top-N alternatives; the first token has none.

A row that asks for them keeps the logits of every prompt position its prefill computes (the
pass keeps those rows besides each sampling chunk's last token), and skips the prefix cache
until all its prompt entries are in: a cached block's positions are never computed, so their
logits would be missing. The entries are the model's raw distribution (log_softmax of its
logits, before temperature, penalties or bias), as vLLM returns them and as a teacher-forced
transformers forward computes them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.core.scheduler import ScheduledChunk
from engine.core.sequence import Sequence
from engine.sample.token_options import indexes_on


@dataclass
class PromptLogprobRows:
    """Which logits a pass keeps when some chunk collects prompt logprobs."""

    keep: list[int]
    """Token indices of the pass whose logits are returned, ascending."""
    sampling: list[int]
    """Rows of the returned logits that are the sampling chunks' last tokens, in chunk order."""
    collect: list[tuple[Sequence, int, int]]
    """(row, first returned logits row, count): logits rows predicting the row's next prompt entries."""


def prompt_logprob_rows(chunks: list[ScheduledChunk]) -> PromptLogprobRows | None:
    """The pass's kept logits, or None when no chunk collects prompt logprobs (the usual pass)."""
    keep: list[int] = []
    sampling: list[int] = []
    collect: list[tuple[Sequence, int, int]] = []
    offset = 0
    for c in chunks:
        seq = c.seq
        if seq.collects_prompt_logprobs:
            # position p predicts token p + 1: the entries still missing start at len(prompt_logprobs)
            first = max(c.start, len(seq.prompt_logprobs) - 1)
            last = min(c.start + c.count, seq.num_prompt_tokens - 1)  # exclusive
            if first < last and first == len(seq.prompt_logprobs) - 1:
                collect.append((seq, len(keep), last - first))
                keep.extend(range(offset + first - c.start, offset + last - c.start))
        if c.samples:
            sampling.append(len(keep))
            keep.append(offset + c.count - 1)
        offset += c.count
    if not collect:
        return None
    return PromptLogprobRows(keep, sampling, collect)




def collect_prompt_logprobs(rows: PromptLogprobRows, logits: torch.Tensor) -> None:
    """Appends each collecting row's entries, {token id: logprob} for the prompt token (first)
    and its top-N alternatives, from the pass's kept logits (one host transfer per row)."""
    for seq, start, n in rows.collect:
        targets = seq.prompt_token_ids[len(seq.prompt_logprobs):len(seq.prompt_logprobs) + n]
        index = indexes_on(targets, logits.device)[:, None]
        lp = torch.log_softmax(logits[start:start + n].float(), dim=-1)  # a view, then one (n, V) result
        picked = lp.gather(1, index)
        want = seq.params.prompt_logprobs or 0
        columns = [picked.double(), ((lp > picked).sum(1, keepdim=True) + 1).double()]
        if want:
            top = lp.topk(want)
            columns += [top.values.double(), top.indices.double()]
        host = torch.cat(columns, dim=1).cpu().numpy()  # chosen, rank, top values, top ids: one transfer
        chosen, ranks = host[:, 0].tolist(), host[:, 1].astype(np.int64).tolist()
        values, ids = host[:, 2:2 + want].tolist(), host[:, 2 + want:].astype(np.int64).tolist()
        for k, target in enumerate(targets):
            entry = {target: chosen[k]}
            if want:
                entry.update(zip(ids[k], values[k]))
            seq.prompt_logprobs.append(entry)
            seq.prompt_logprob_ranks.append(ranks[k])
