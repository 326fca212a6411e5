"""The sampling options that act on token ids (vLLM's names): logit_bias, allowed_token_ids and
bad_words, checked against the vocabulary when a request is added.

logit_bias, allowed_token_ids and the bad words of one token are a fixed additive bias per row
(the batch's `bias` table, written when the row joins); a bad word of several tokens bans its
last token only where the row's output ends with the others, which the host knows from the
tokens it already holds (no device read): `dynamic_bans` lists those (row, token) pairs per step.
"""
from __future__ import annotations

import torch

from engine.api.sampling_params import SamplingParams
from engine.core.sequence import Sequence
from engine.models.tokenizer import Tokenizer


def check_request(params: SamplingParams, vocab_size: int, max_logprobs: int) -> None:
    """ValueError naming the field when the request names a token outside the vocabulary or asks
    for more logprobs than the engine returns."""
    bad = [t for t in params.token_ids_used() if t >= vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if params.logprobs is not None and params.logprobs > max_logprobs:
        raise ValueError(f"logprobs {params.logprobs} is above max_logprobs ({max_logprobs}; EngineConfig.max_logprobs)")
    if params.prompt_logprobs is not None and params.prompt_logprobs > max_logprobs:
        raise ValueError(f"prompt_logprobs {params.prompt_logprobs} is above max_logprobs ({max_logprobs}; "
                         "EngineConfig.max_logprobs)")


def bad_word_sequences(tokenizer: Tokenizer, words: list[str]) -> list[tuple[int, ...]]:
    """The token sequences of `words`, as vLLM bans them: each word without its leading spaces,
    and with one leading space where that is a sequence of as many tokens whose first differs
    (the word in the middle of a text)."""
    found: list[tuple[int, ...]] = []

    def encode(text: str) -> tuple[int, ...]:
        return tuple(tokenizer.hf(text, add_special_tokens=False)["input_ids"])

    for word in words:
        plain, spaced = encode(word.lstrip()), encode(" " + word.lstrip())
        for ids in (plain, spaced if plain and len(spaced) == len(plain) and spaced[0] != plain[0] else ()):
            if ids and ids not in found:
                found.append(ids)
    return found


def indexes_on(values: list, device: torch.device) -> torch.Tensor:
    """`values` (ints, or lists of them) as an int64 tensor on `device`: to CUDA from pinned
    memory, without waiting on the stream as a copy from pageable memory does."""
    t = torch.tensor(values, dtype=torch.int64)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def has_bias(seq: Sequence) -> bool:
    p = seq.params
    return p.logit_bias is not None or p.allowed_token_ids is not None or any(len(w) == 1 for w in seq.bad_words)


def bias_rows(seqs: list[Sequence], vocab_size: int) -> torch.Tensor:
    """(k, V) float32 on the host: each row's fixed bias (0 for a row with none)."""
    rows = torch.zeros((len(seqs), vocab_size), dtype=torch.float32)
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.allowed_token_ids is not None:
            rows[i] = float("-inf")
            rows[i, torch.tensor(p.allowed_token_ids, dtype=torch.int64)] = 0.0
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.int64)
            rows[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=torch.float32)
        single = [w[0] for w in seq.bad_words if len(w) == 1]
        if single:
            rows[i, torch.tensor(single, dtype=torch.int64)] = float("-inf")
    return rows


def dynamic_bans(seqs: list[Sequence]) -> tuple[list[int], list[int]]:
    """(row indexes, token ids): the last token of each bad word of several tokens whose other
    tokens end the row's output now."""
    rows, tokens = [], []
    for i, seq in enumerate(seqs):
        out = seq.output_token_ids
        for word in seq.bad_words:
            k = len(word) - 1
            if k and len(out) >= k and tuple(out[-k:]) == word[:-1]:
                rows.append(i)
                tokens.append(word[-1])
    return rows, tokens
