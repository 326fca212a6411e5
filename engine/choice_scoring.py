"""Choice scoring: the log-likelihood of each candidate continuation after a prompt.

For labeling by scoring instead of free generation. Rows are scored in groups whose blocks fit
the KV pool's free blocks. Per group:

1. the prompts, in chunks under max_num_batched_tokens, into blocks of the pool (a prefix
   cached there is taken, not computed; rows of a group that share a block not cached yet
   compute it once); the logits at each prompt's last token score first choice tokens;
2. every choice longer than one token, as a row whose block table starts with its prompt's
   full blocks (shared, not copied) and a copy of the prompt's last partial block.

Full prompt blocks are named afterwards, so later rows and generation requests reuse them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.api.outputs import ChoiceScores
from engine.api.sampling_params import SamplingParams
from engine.core.block_pool import chain_hashes
from engine.core.paged import PagedPass
from engine.core.scheduler import ScheduledChunk
from engine.core.sequence import LOGITS_BYTES, Sequence  # pass 2 runs in chunks of choice tokens under it


@dataclass
class ChoiceRows:
    """A score_choices call's rows read into token ids: each prompt's ids, its choices' ids and its
    images; rows that could not be read keep their error."""

    prompts: list[list[int]] = field(default_factory=list)
    choices: list[list[list[int]]] = field(default_factory=list)
    images: list[list] = field(default_factory=list)
    failed: dict[int, str] = field(default_factory=dict)

    def score(self, paged: PagedPass, adapters, loras: list) -> list[ChoiceScores]:
        """Every row's ChoiceScores, the rows of each adapter scored together (AdapterRouter.per_adapter)."""
        scores = adapters.per_adapter(
            loras, lambda rows: score_choices(paged, [self.prompts[i] for i in rows], [self.choices[i] for i in rows],
                                              [self.images[i] for i in rows]),
            lambda message: ChoiceScores([], [], 0, message))
        for i, message in self.failed.items():
            scores[i] = ChoiceScores([], [], 0, message)
        return scores


def choice_rows(reader, prompts, choices) -> ChoiceRows:
    """Reads each row's prompt (engine.prompt_reader.PromptReader) and its choices as they continue it
    (an image prompt's choices are tokenized on their own); a row that cannot be read keeps its error."""
    rows = ChoiceRows()
    for i, (p, cs) in enumerate(zip(prompts, choices)):
        spans = []
        try:
            ids, spans = reader.read(p)
            cids = [reader.tokenizer.continuation(None if spans else p, ids, c) for c in cs]
        except (TypeError, ValueError) as exc:
            rows.failed[i] = str(exc)
            ids, cids = [], []
        rows.prompts.append(ids)
        rows.choices.append(cids)
        rows.images.append(spans)
    return rows


def score_choices(paged: PagedPass, prompts: list[list[int]], choices: list[list[list[int]]],
                  images: list[list] | None = None) -> list[ChoiceScores]:
    """prompts[i] and choices[i][j] are token ids (images[i]: prompt i's image spans,
    engine.multimodal); returns one ChoiceScores per row, in order."""
    images = images or [[] for _ in prompts]
    results: list[ChoiceScores | None] = [None] * len(prompts)
    pool = paged.pool
    todo = []
    for i, (p, cs) in enumerate(zip(prompts, choices)):
        need = _blocks(pool, p, cs)
        if not p:
            results[i] = ChoiceScores([], [], 0, "empty prompt: a row needs at least one prompt token")
        elif not cs or any(not c for c in cs):
            results[i] = ChoiceScores([], [], len(p), "every row needs at least one non-empty choice")
        elif len(p) + max(len(c) for c in cs) > paged.max_model_len:
            results[i] = ChoiceScores([], [], len(p), f"prompt ({len(p)} tokens) + longest choice exceeds "
                                                      f"max_model_len ({paged.max_model_len})")
        elif need > pool.num_blocks:
            results[i] = ChoiceScores([], [], len(p), f"prompt ({len(p)} tokens) and {len(cs)} choices need {need} "
                                                      f"KV blocks of {pool.block_size} tokens, more than the pool "
                                                      f"holds: max_batch_tokens ({paged.pool_tokens})")
        else:
            todo.append(i)
    group: list[int] = []
    used = 0
    for i in todo + [None]:
        need = _blocks(pool, prompts[i], choices[i]) if i is not None else 0
        if group and (i is None or used + need > pool.num_free):
            for j, scores in zip(group, _score_group(paged, [prompts[j] for j in group], [choices[j] for j in group],
                                                     [images[j] for j in group])):
                results[j] = scores
            group, used = [], 0
        if i is not None:
            group.append(i)
            used += need
    return results


def _blocks(pool, prompt: list[int], choices: list[list[int]]) -> int:
    """Blocks a row needs at most: its prompt's, plus per longer choice a partial copy and its own."""
    bs = pool.block_size
    extra = sum(-(-(len(prompt) % bs + len(c)) // bs) for c in choices if len(c) > 1)
    return -(-len(prompt) // bs) + extra


@torch.inference_mode()
def _score_group(paged: PagedPass, prompts: list[list[int]], choices: list[list[list[int]]],
                 images: list[list]) -> list[ChoiceScores]:
    pool, runner, bs = paged.pool, paged.runner, paged.block_size
    seqs = [paged.stamp(Sequence(index=i, prompt_token_ids=p, params=SamplingParams(max_tokens=1), seed=0,
                                 images=spans)) for i, (p, spans) in enumerate(zip(prompts, images))]
    forks: list[Sequence] = []
    try:
        last = _prompts(paged, seqs)  # (R, V) logits at each prompt's last token
        first = torch.log_softmax(last, dim=-1)
        totals = [[float(first[i, c[0]]) for c in cs] for i, cs in enumerate(choices)]
        work = []  # (row, choice index, fork)
        for i, (seq, cs) in enumerate(zip(seqs, choices)):
            full = len(seq.prompt_token_ids) // bs
            for j, c in enumerate(cs):
                if len(c) < 2:
                    continue
                fork = paged.stamp(Sequence(index=i, prompt_token_ids=seq.prompt_token_ids + c[:-1],
                                                   params=SamplingParams(max_tokens=1), seed=0, images=seq.images))
                fork.block_ids = pool.table(seq.block_ids[:full], fork.num_tokens)
                if len(seq.prompt_token_ids) % bs:
                    runner.copy_block(paged.cache, seq.block_ids[full], fork.block_ids[full])
                forks.append(fork)
                work.append((i, j, fork))
        per_pass = max(1, min(paged.max_num_batched_tokens, LOGITS_BYTES // (runner.vocab_size * 4)))
        start = 0
        while start < len(work):
            end, tokens = start, 0
            while end < len(work) and (end == start or tokens + len(choices[work[end][0]][work[end][1]]) <= per_pass):
                tokens += len(choices[work[end][0]][work[end][1]]) - 1
                end += 1
            chunks = [ScheduledChunk(f, len(prompts[i]), len(choices[i][j]) - 1) for i, j, f in work[start:end]]
            logits = runner.run(paged.cache, chunks, all_logits=True)
            lp = torch.log_softmax(logits, dim=-1)
            t = 0
            for i, j, _ in work[start:end]:
                c = choices[i][j]
                ids = torch.tensor(c[1:], device=lp.device)
                totals[i][j] += float(lp[t:t + len(c) - 1].gather(1, ids[:, None]).sum())
                t += len(c) - 1
            start = end
    finally:
        for fork in forks:
            pool.release(fork.block_ids)
        for seq in seqs:
            _name_full_blocks(paged, seq)
            pool.release(seq.block_ids)
    return [ChoiceScores(t, [len(c) for c in cs], len(p), num_cached_tokens=s.num_cached_tokens or 0)
            for t, cs, p, s in zip(totals, choices, prompts, seqs)]


def _prompts(paged: PagedPass, seqs: list[Sequence]) -> torch.Tensor:
    """Computes the prompts into pool blocks; -> float32 logits (R, V) at each one's last token.
    A row whose next uncached block another row is computing (in this pass or, for a prefill
    longer than a pass, still) waits for it, so shared prefixes are computed once."""
    pool, bs = paged.pool, paged.block_size
    for seq in seqs:
        seq.block_names = chain_hashes(seq.named_tokens, bs, paged.salt_of(seq), seq.num_prompt_tokens - 1)
    out: list[torch.Tensor | None] = [None] * len(seqs)
    pending = list(range(len(seqs)))
    while pending:
        chunks, rows, later, budget = [], [], [], paged.max_num_batched_tokens
        # blocks rows already under way have yet to compute (their prefill may span passes)
        inflight = {name for r in pending if seqs[r].block_ids
                    for name in seqs[r].block_names[seqs[r].num_computed_tokens // bs:]}
        for r in pending:
            seq = seqs[r]
            if not seq.block_ids:  # first visit: take the cached prefix, allocate the rest
                cached = pool.match(seq.block_names)
                if pool.caching and len(cached) < len(seq.block_names) and seq.block_names[len(cached)] in inflight:
                    later.append(r)
                    continue
                seq.block_ids = pool.table(cached, seq.num_prompt_tokens)
                seq.num_computed_tokens = seq.num_cached_tokens = len(cached) * bs
                pool.count_lookup(seq.num_prompt_tokens, seq.num_computed_tokens)
                inflight.update(seq.block_names[len(cached):])
            if budget <= 0:
                later.append(r)
                continue
            n = min(seq.num_prompt_tokens - seq.num_computed_tokens, budget)
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            rows.append(r)
            budget -= n
        logits = paged.runner.run(paged.cache, chunks)
        k = 0
        for chunk, r in zip(chunks, rows):
            chunk.seq.num_computed_tokens += chunk.count
            _name_full_blocks(paged, chunk.seq)
            if chunk.samples:
                out[r] = logits[k]
                k += 1
            else:
                later.append(r)
        pending = sorted(later)
    return torch.stack(out)


def _name_full_blocks(paged: PagedPass, seq: Sequence) -> None:
    """Names the row's computed full prompt blocks, so later rows find them cached."""
    full = min(seq.num_computed_tokens, seq.num_prompt_tokens) // paged.block_size
    names = chain_hashes(seq.named_tokens, paged.block_size, paged.salt_of(seq), full * paged.block_size,
                         seq.block_names)
    for i in range(min(full, len(seq.block_ids))):
        paged.pool.name(seq.block_ids[i], names[i])
