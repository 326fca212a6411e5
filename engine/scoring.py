"""Choice scoring: the log-likelihood of each candidate continuation after a prompt.

For labeling by scoring instead of free generation. Rows are packed into groups under the KV
budget. Per group, two forward passes:

1. the prompts (right-padded), whose last position gives each choice's first token;
2. every choice of every row at once, after its prompt's keys and values are copied into one
   cache row per choice (the prompt is computed once, not once per choice). Skipped when every
   choice is a single token.

In pass 2 all choices start at the same column (after the longest prompt of the group); the
attention mask hides the gap after shorter prompts and position ids carry on from each prompt's
own length, so every choice token sees exactly its prompt and the choice tokens before it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv_cache import KVCache
from engine.prefix_cache import PrefixCache
from engine.scheduler import kv_tokens

LOGITS_BYTES = 256 * 2**20
"""Pass 2 runs in chunks of choice rows whose float32 logits stay under this size."""


@dataclass
class ChoiceScores:
    """The scores of one row's choices, in the order given."""

    logprobs: list[float]
    """Summed log-probability of each choice's tokens after the prompt."""
    num_tokens: list[int]
    """Tokens in each choice."""
    num_prompt_tokens: int
    """Tokens in the prompt."""
    error: str | None = None
    """Why the row could not be scored (then logprobs is empty)."""


def score_choices(runner, cache: KVCache, prompts: list[list[int]], choices: list[list[list[int]]],
                  max_batch_tokens: int, max_num_seqs: int, max_model_len: int,
                  prefix_cache: PrefixCache | None = None) -> list[ChoiceScores]:
    """prompts[i] and choices[i][j] are token ids; returns one ChoiceScores per row, in order."""
    results: list[ChoiceScores | None] = [None] * len(prompts)
    todo = []
    for i, (p, cs) in enumerate(zip(prompts, choices)):
        need = kv_tokens(len(cs), len(p) + max((len(c) for c in cs), default=0))
        if not p:
            results[i] = ChoiceScores([], [], 0, "empty prompt: a row needs at least one prompt token")
        elif not cs or any(not c for c in cs):
            results[i] = ChoiceScores([], [], len(p), "every row needs at least one non-empty choice")
        elif len(p) + max(len(c) for c in cs) > max_model_len:
            results[i] = ChoiceScores([], [], len(p), f"prompt ({len(p)} tokens) + longest choice exceeds "
                                                      f"max_model_len ({max_model_len})")
        elif need > max_batch_tokens or len(cs) > max_num_seqs:
            results[i] = ChoiceScores([], [], len(p), f"{len(cs)} choices x (prompt {len(p)} + longest choice) "
                                                      f"= {need} tokens exceeds max_batch_tokens ({max_batch_tokens})"
                                      if need > max_batch_tokens else
                                      f"{len(cs)} choices exceed max_num_seqs ({max_num_seqs})")
        else:
            todo.append(i)
    for group in _groups(todo, prompts, choices, max_batch_tokens, max_num_seqs):
        for i, scores in zip(group, _score_group(runner, cache, [prompts[i] for i in group],
                                                 [choices[i] for i in group], prefix_cache)):
            results[i] = scores
    return results


def _groups(rows, prompts, choices, max_batch_tokens: int, max_num_seqs: int):
    """Consecutive rows whose choice rows x (longest prompt + longest choice) fit the budget:
    the cache _score_group allocates."""
    group, n, longest_prompt, longest_choice = [], 0, 0, 0
    for i in rows:
        k = len(choices[i])
        p = max(longest_prompt, len(prompts[i]))
        c = max(longest_choice, max(len(x) for x in choices[i]))
        if group and (kv_tokens(n + k, p + c) > max_batch_tokens or n + k > max_num_seqs):
            yield group
            group, n = [], 0
            p, c = len(prompts[i]), max(len(x) for x in choices[i])
        group.append(i)
        n, longest_prompt, longest_choice = n + k, p, c
    if group:
        yield group


@torch.inference_mode()
def _score_group(runner, cache: KVCache, prompts: list[list[int]], choices: list[list[list[int]]],
                 prefix_cache: PrefixCache | None) -> list[ChoiceScores]:
    device = runner.device
    plens = torch.tensor([len(p) for p in prompts], device=device)
    plen = int(plens.max())
    clen = max(len(c) for cs in choices for c in cs)
    owner = torch.tensor([i for i, cs in enumerate(choices) for _ in cs], device=device)  # choice row -> prompt row
    flat = [c for cs in choices for c in cs]
    cache.set_layout(len(prompts), plen + clen, device=device)

    # Pass 1: prompts, right-padded, after the prefix they all share when it is cached; the
    # logits at each prompt's last token score first choice tokens.
    rows = list(range(len(prompts)))
    offset = prefix_cache.shared_prefix(runner, rows, prompts) if prefix_cache is not None else 0
    ids = torch.zeros((len(prompts), plen - offset), dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, : len(p) - offset] = torch.tensor(p[offset:])
    first = runner.prefill(cache, 0, ids.to(device), plens, offset)
    if prefix_cache is not None:
        prefix_cache.store(rows, prompts)
    first = torch.log_softmax(first, dim=-1)[owner]  # (C, V)
    firsts = torch.tensor([c[0] for c in flat], device=device)
    totals = first.gather(1, firsts[:, None])[:, 0]  # (C,)

    if clen > 1:
        # Pass 2: each choice row starts from a copy of its prompt's keys and values.
        cache.expand_rows(owner)
        cids = torch.zeros((len(flat), clen), dtype=torch.int64)
        for j, c in enumerate(flat):
            cids[j, : len(c)] = torch.tensor(c)
        cids = cids.to(device)
        clens = torch.tensor([len(c) for c in flat], device=device)
        ccols = torch.arange(clen, device=device)[None, :]
        all_cols = torch.arange(plen + clen, device=device)[None, :]
        own_plen = plens[owner][:, None]
        keys = (all_cols < own_plen) | ((all_cols >= plen) & (all_cols < plen + clens[:, None]))  # (C, plen + clen)
        later = []
        # in chunks of rows, so the (rows, choice length, vocab) logits stay under LOGITS_BYTES
        step = max(1, LOGITS_BYTES // (clen * runner.vocab_size * 4))
        for a in range(0, len(flat), step):
            rows = slice(a, a + step)
            cache.prefill(a, offset=plen)
            bias = runner.attention_bias(keys[rows], (plen + ccols).expand(keys[rows].shape[0], -1))
            logits = runner.logits(cids[rows], bias, own_plen[rows] + ccols, cache)  # (r, L, V)
            # token t+1 of a choice is scored at the position of token t
            lp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(2, cids[rows, 1:, None])[:, :, 0]
            later.append(lp.masked_fill(ccols[:, 1:] >= clens[rows, None], 0.0).sum(dim=1))
        totals = totals + torch.cat(later)

    out, j = [], 0
    totals = totals.tolist()
    for p, cs in zip(prompts, choices):
        out.append(ChoiceScores(totals[j: j + len(cs)], [len(c) for c in cs], len(p)))
        j += len(cs)
    return out
