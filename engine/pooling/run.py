"""embed, classify and score: rows tokenized and checked (a bad row gets its error, the others
go on), run longest first in passes under max_num_batched_tokens, pooled, and handed back in
input order. One BatchStats per call."""
from __future__ import annotations

import time
from typing import Sequence as Seq

import torch
import torch.nn.functional as F

from engine.api.outputs import BatchStats, ClassificationOutput, EmbeddingOutput, ScoringOutput
from engine.api.pooling import PoolingParams
from engine.api.prompts import Prompt, per_prompt
from engine.core.paged import PagedPass
from engine.models.pooling import PoolingInfo
from engine.pooling import decoder
from engine.pooling.pooler import PostPooling, finish_embeddings, head_activation, pool_rows



class Pooler:
    """The pooling side of one LLMEngine: an encoder runner of its own, or passes over the engine's
    paged decoder. It holds the pieces it uses, never the engine; the engine checks that a call's
    task is the model's and that no generation is running before it calls in."""

    def __init__(self, info: PoolingInfo, batch_stats: list[BatchStats], max_model_len: int,
                 max_num_batched_tokens: int, *, encoder=None, paged: PagedPass | None = None):
        self.info = info
        self.encoder = encoder
        """engine.pooling.encoder.EncoderRunner for encoders; None: passes over the engine's pool (`paged`)."""
        self.paged = paged
        self.batch_stats = batch_stats
        """The engine's list: one BatchStats per call is appended."""
        self.budget = max_num_batched_tokens
        runner = encoder if encoder is not None else paged.runner
        self.tokenizer = runner.hf_tokenizer
        self.vocab_size = runner.vocab_size
        self.post = PostPooling(info.dense, runner.device) if info.dense else None
        limits = [n for n in (info.max_len, max_model_len) if n]
        self.max_len = min(limits) if limits else None
        """Longest row the model reads."""

    # -- the three tasks -----------------------------------------------------------------------

    def embed(self, prompts: Seq[Prompt], params: PoolingParams | Seq[PoolingParams] | None) -> list[EmbeddingOutput]:
        prompts, params = per_prompt(prompts, params, PoolingParams)
        rows, errors = self._rows(prompts, params)
        for i, p in enumerate(params):
            if errors[i] is None:
                errors[i] = self._dimensions_error(p.dimensions)
        pooled = self._pool(rows, errors)
        out: list[EmbeddingOutput] = []
        good = [i for i in range(len(rows)) if errors[i] is None]
        vectors = finish_embeddings(torch.stack([pooled[i] for i in good]), self.post,
                                    [params[i].dimensions for i in good],
                                    [self.info.normalize if params[i].normalize is None else params[i].normalize
                                     for i in good]) if good else []
        by_row = dict(zip(good, vectors))
        for i, row in enumerate(rows):
            out.append(EmbeddingOutput(by_row[i], len(row), None, row) if i in by_row
                       else EmbeddingOutput([], len(row or ()), errors[i], row))
        return out

    def classify(self, prompts: Seq[Prompt], params: PoolingParams | Seq[PoolingParams] | None
                 ) -> list[ClassificationOutput]:
        prompts, params = per_prompt(prompts, params, PoolingParams)
        rows, errors = self._rows(prompts, params)
        logits = self._logits(rows, errors)
        out = []
        for i, row in enumerate(rows):
            if errors[i] is not None:
                out.append(ClassificationOutput([], None, len(row or ()), errors[i], row))
                continue
            probs = head_activation(logits[i][None], self.info)[0]
            values = probs if params[i].use_activation is not False else logits[i]
            out.append(ClassificationOutput(values.tolist(), self.info.labels[int(probs.argmax())], len(row), None, row))
        return out

    def score(self, text_1: Prompt | Seq[Prompt], text_2: Prompt | Seq[Prompt],
              params: PoolingParams | None) -> list[ScoringOutput]:
        firsts, seconds = score_pairs(text_1, text_2)
        params = params or PoolingParams()
        if not self.info.classifier:  # an embedding model: the cosine of the two embeddings
            embs = self.embed(firsts + seconds, PoolingParams(normalize=True, dimensions=params.dimensions,
                                                              truncate_prompt_tokens=params.truncate_prompt_tokens))
            n = len(firsts)
            out = []
            for a, b in zip(embs[:n], embs[n:]):
                if a.error or b.error:
                    out.append(ScoringOutput(None, a.num_prompt_tokens + b.num_prompt_tokens, a.error or b.error))
                else:
                    out.append(ScoringOutput(float(F.cosine_similarity(torch.tensor(a.embedding),
                                                                       torch.tensor(b.embedding), dim=0)),
                                             a.num_prompt_tokens + b.num_prompt_tokens))
            return out
        rows, types, errors = self._pair_rows(firsts, seconds, params)
        logits = self._logits(rows, errors, types)
        out = []
        for i, row in enumerate(rows):
            if errors[i] is not None:
                out.append(ScoringOutput(None, len(row or ()), errors[i]))
                continue
            value = head_activation(logits[i][None], self.info)[0] if params.use_activation is not False \
                else logits[i]
            out.append(ScoringOutput(float(value[0]), len(row)))
        return out

    # -- rows ------------------------------------------------------------------------------------

    def _rows(self, prompts: list, params: list[PoolingParams]):
        rows: list[list[int] | None] = []
        errors: list[str | None] = []
        for prompt, p in zip(prompts, params):
            try:
                rows.append(self._fit(self._tokenize(prompt), p.truncate_prompt_tokens))
                errors.append(None)
            except (TypeError, ValueError) as exc:
                rows.append(None)
                errors.append(str(exc))
        return rows, errors

    def _pair_rows(self, firsts: list, seconds: list, params: PoolingParams):
        rows, types, errors = [], [], []
        for a, b in zip(firsts, seconds):
            try:
                if not (isinstance(a, str) and isinstance(b, str)):
                    raise TypeError("score: a cross-encoder reads text pairs (text_1 and text_2 as strings)")
                if not a or not b:
                    raise ValueError("empty text: both texts of a pair need at least one character")
                enc = self.tokenizer(a, b, add_special_tokens=True, verbose=False)
                ids = enc["input_ids"]
                tt = enc.get("token_type_ids") or [0] * len(ids)
                ids = self._fit(ids, params.truncate_prompt_tokens)
                rows.append(ids)
                types.append(tt[len(tt) - len(ids):])
                errors.append(None)
            except (TypeError, ValueError) as exc:
                rows.append(None)
                types.append(None)
                errors.append(str(exc))
        return rows, types, errors

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("empty text: a row needs at least one character")
            return self.tokenizer(prompt, add_special_tokens=True, verbose=False)["input_ids"]
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                                for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
            return list(prompt)
        if isinstance(prompt, (list, tuple)) and not prompt:
            raise ValueError("empty prompt: a row needs at least one token")
        raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def _fit(self, ids: list[int], truncate: int | None) -> list[int]:
        limit = self.max_len
        if truncate is not None:
            if limit and truncate > limit:
                raise ValueError(f"truncate_prompt_tokens ({truncate}) exceeds the model's limit of {limit} tokens")
            return ids[-truncate:]
        if limit and len(ids) > limit:
            raise ValueError(f"the row has {len(ids)} tokens, more than the model's limit of {limit} "
                             "(set truncate_prompt_tokens to keep the last N)")
        return ids

    def _dimensions_error(self, d: int | None) -> str | None:
        if d is None:
            return None
        m, width = self.info.matryoshka, self.info.width
        if d > width:
            return f"dimensions ({d}) exceeds the model's embedding width ({width})"
        if m is False:
            return (f"dimensions: {self.info.name} is not a Matryoshka model (its config names no "
                    "matryoshka_dimensions or is_matryoshka), so its embeddings cannot be cut")
        if m is not True and d not in m and d != width:
            return f"dimensions ({d}) is not one of the model's matryoshka_dimensions {list(m)}"
        return None

    # -- passes ----------------------------------------------------------------------------------

    def _logits(self, rows, errors, types=None) -> dict[int, torch.Tensor]:
        pooled = self._pool(rows, errors, types)
        if not pooled:
            return {}
        idx = sorted(pooled)
        heads = self.encoder.head(torch.stack([pooled[i] for i in idx])) if self.encoder is not None else \
            self.paged.runner.model.score(torch.stack([pooled[i] for i in idx]).to(self.paged.runner.dtype)).float()
        return dict(zip(idx, heads))

    def _pool(self, rows, errors, types=None) -> dict[int, torch.Tensor]:
        """Row index -> pooled state (H,) of every row without an error, longest first under the budget."""
        todo = sorted((i for i in range(len(rows)) if errors[i] is None), key=lambda i: -len(rows[i]))
        budget = self.budget
        out: dict[int, torch.Tensor] = {}
        start_time, passes, computed = time.perf_counter(), 0, 0
        start = 0
        while start < len(todo):
            end, tokens = start, 0
            while end < len(todo) and (end == start or tokens + len(rows[todo[end]]) <= budget):
                tokens += len(rows[todo[end]])
                end += 1
            batch = todo[start:end]
            pooled = self._pass([rows[i] for i in batch], [types[i] for i in batch] if types else None)
            out.update(zip(batch, pooled))
            passes += 1 if self.encoder is not None else -(-tokens // budget)
            computed += tokens
            start = end
        if todo:
            lens = [len(rows[i]) for i in todo]
            self.batch_stats.append(BatchStats(
                rows=len(todo), max_prompt_len=max(lens), max_new_tokens=0, reserved_tokens=0,
                prompt_tokens=sum(lens), padded_prompt_tokens=computed, peak_rows=len(todo), prefill_steps=passes,
                seconds=time.perf_counter() - start_time))
        return out

    def _pass(self, rows: list[list[int]], types) -> torch.Tensor:
        kind = self.info.pooling_type
        if self.encoder is None:
            return decoder.pooled_states(self.paged, rows, kind)
        states = self.encoder.states(rows, types)
        return pool_rows(states, [len(r) for r in rows], kind)


def score_pairs(text_1, text_2) -> tuple[list, list]:
    """vLLM's forms: one text_1 with a list of text_2 (each paired with it), or two lists of one length."""
    one = lambda t: isinstance(t, str) or (isinstance(t, list) and t and isinstance(t[0], int))  # noqa: E731
    seconds = [text_2] if one(text_2) else list(text_2)
    if one(text_1):
        return [text_1] * len(seconds), seconds
    firsts = list(text_1)
    if len(firsts) != len(seconds):
        raise ValueError(f"score: text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, or "
                         "lists of the same length")
    return firsts, seconds
