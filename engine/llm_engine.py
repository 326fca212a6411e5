"""LLMEngine: takes requests, forms batches, runs them, returns completions in input order."""
from __future__ import annotations

import logging
import random
from typing import Sequence as Seq

from engine.batch import Batch
from engine.config import EngineConfig
from engine.kv_cache import KVCache
from engine.model_runner import ModelRunner
from engine.prefix_cache import BLOCK_SIZE, PrefixCache, block_hashes
from engine.outputs import BatchStats, Completion
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput, pool_capacity, prefill_capacity
from engine.scoring import ChoiceScores, score_choices
from engine.sequence import Sequence
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

Prompt = str | list[int]
GRAPH_WIDTH_ALIGN = 128
"""With CUDA graphs, KV layout widths are rounded up to this, so batches of similar widths share
one layout and its captured graphs (costs at most max_num_seqs x 127 extra pool slots)."""
GRAPH_MIN_JOIN = 1 / 8
"""With CUDA graphs, continuous batching refills the batch once 1/8 of its rows are free, not
row by row: decode steps replay a graph in a few ms, but every prefill is an eager forward pass
whose host time (tens of ms for a 1B model) does not shrink with its size."""


class LLMEngine:
    """A single-process generation engine.

    >>> llm = LLMEngine(EngineConfig(model="builtin:tiny"))
    >>> outs = llm.generate(["Hello", "Bonjour"], SamplingParams(max_tokens=8, temperature=0))
    """

    def __init__(self, config: EngineConfig | None = None, **overrides):
        self.config = config if config is not None else EngineConfig(**overrides)
        if config is not None and overrides:
            raise TypeError("pass either an EngineConfig or keyword overrides, not both")
        self.runner = ModelRunner(self.config)
        self.tokenizer = Tokenizer(self.runner.hf_tokenizer, self.runner.eos_token_ids())
        self.max_model_len = self._max_model_len()
        self.continuous = self.config.scheduling == "continuous"
        width_align = GRAPH_WIDTH_ALIGN if self.runner.graphs is not None else 1
        self.cache = KVCache(self.runner.num_layers,
                             pool_capacity(self.config.max_batch_tokens, self.config.max_num_seqs, width_align))
        """The KV pool: allocated on the first forward pass, reused by every batch and by scoring."""
        self.prefix_cache: PrefixCache | None = None
        if self.config.enable_prefix_caching:
            self.prefix_cache = PrefixCache(self.cache, self.config.prefix_cache_tokens
                                            or self.config.max_batch_tokens // 2)
        self.scheduler = Scheduler(self.config.max_batch_tokens, self.config.max_num_seqs, self.max_model_len,
                                   self._max_prefill_tokens(), self.continuous, width_align,
                                   cached_tokens=self._cached_tokens if self.prefix_cache else None,
                                   min_join_fraction=GRAPH_MIN_JOIN if self.runner.graphs is not None else 0.0)
        self.batch = Batch(self.tokenizer, self.runner.device, self.runner.vocab_size, self.cache)
        self.sampler = Sampler(self.runner.vocab_size, self.runner.device)
        self._seed_rng = random.Random(self.config.seed)
        self._next_index = 0
        self.batch_stats: list[BatchStats] = []
        """Statistics of every batch run so far, in order."""

    def _max_model_len(self) -> int:
        model_max = self.runner.max_position_embeddings
        if self.config.max_model_len is None:
            return model_max or self.config.max_batch_tokens
        if model_max and self.config.max_model_len > model_max:
            raise ValueError(f"max_model_len ({self.config.max_model_len}) exceeds the model's "
                             f"max_position_embeddings ({model_max})")
        return self.config.max_model_len

    def _max_prefill_tokens(self) -> int:
        return prefill_capacity(self.config.max_prefill_tokens, self.config.max_batch_tokens,
                                on_cpu=self.runner.device.type == "cpu")

    # -- requests -----------------------------------------------------------------------------

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None) -> Sequence:
        """Tokenizes and queues one request; a request that can never run is finished with an error."""
        params = params or SamplingParams()
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        seq = Sequence(index=self._next_index, prompt_token_ids=[], params=params, seed=seed)
        self._next_index += 1
        try:
            seq.prompt_token_ids = self._tokenize(prompt)
        except (TypeError, ValueError) as exc:
            seq.fail(str(exc))
            return seq
        self.scheduler.add(seq)
        return seq

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("empty prompt: a request needs at least one prompt token")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                     for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.runner.vocab_size]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.runner.vocab_size})")
            return list(prompt)
        raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def has_unfinished(self) -> bool:
        return not self.batch.empty or self.scheduler.has_work()

    # -- the loop -----------------------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """One forward pass: schedule -> run -> postprocess. Either a prefill that brings
        admitted requests into the batch, or one decode step of every running row. Returns the
        sequences that finished in it."""
        plan = self.scheduler.schedule(self.batch.num_rows, self.batch.widest)
        if plan.is_empty:
            return []
        finished = self._run(plan)
        drained = not (self.continuous and self.scheduler.has_waiting())  # continuous: one batch per run
        if self.batch.empty and not self.scheduler.pending and drained:
            self.batch_stats.append(self.batch.finish_stats())
        return finished

    def _run(self, plan: SchedulerOutput) -> list[Sequence]:
        """Runs the plan's forward pass, samples on the device and records the new tokens."""
        batch = self.batch
        if plan.layout is not None:
            batch.set_layout(*plan.layout)
        if plan.is_prefill:
            group, offset = self._with_cached_prefix(plan.prefill)
            start = batch.num_rows
            rows = slice(start, start + len(group))
            prompts = [s.prompt_token_ids for s in group]
            ids, lengths = batch.join(group, offset)
            if self.prefix_cache is not None:
                self.prefix_cache.load(range(start, rows.stop), prompts, offset)
            logits = self.runner.prefill(self.cache, start, ids, lengths, offset)
            if self.prefix_cache is not None:
                self.prefix_cache.store(range(start, rows.stop), prompts)
        else:
            n = plan.num_decode_rows
            rows = slice(0, n)
            batch.count_decode()
            logits = self.runner.decode(self.cache, batch.last[:n], batch.lengths[:n], batch.max_length() + 1)
        tokens, logprobs = self.sampler(logits, **batch.sampler_inputs(rows))
        return batch.record(rows, tokens, logprobs, decode=not plan.is_prefill)

    def _cached_tokens(self, seq: Sequence) -> int:
        return self.prefix_cache.match(seq.prompt_token_ids)

    def _with_cached_prefix(self, group: list[Sequence]) -> tuple[list[Sequence], int]:
        """The rows of `group` to prefill now and how many leading tokens of theirs come from the
        prefix cache (the same for all: one forward pass has one offset); the others go back to
        the front of the pending rows. Rows that share a block nobody has computed yet run one
        alone first, so the rest find it cached."""
        if self.prefix_cache is None:
            return group, 0
        matched = [self.prefix_cache.match(s.prompt_token_ids) for s in group]
        first_new: dict[int, int] = {}
        for i, (s, m) in enumerate(zip(group, matched)):
            # the block holding the last prompt token is never cached (its logits are needed)
            hashes = block_hashes(s.prompt_token_ids, min(m + BLOCK_SIZE, s.num_prompt_tokens - 1))
            if len(hashes) > m // BLOCK_SIZE:
                j = first_new.setdefault(hashes[m // BLOCK_SIZE], i)
                if j != i:  # rows j and i share an uncached block: compute it once, with row j
                    now = [group[j]]
                    self.scheduler.pending[:0] = [r for r in group if r is not group[j]]
                    return now, matched[j]
        best = max(matched)
        now = [s for s, m in zip(group, matched) if m == best]
        self.scheduler.pending[:0] = [s for s, m in zip(group, matched) if m != best]
        return now, best

    def score_choices(self, prompts: Seq[Prompt], choices: Seq[Seq[str | list[int]]]) -> list[ChoiceScores]:
        """Log-likelihood of each choice after its row's prompt: choices[i] are the candidates for
        prompts[i]. A text choice after a text prompt is tokenized as part of prompt + choice (its
        tokens are those beyond the prompt's), so write it as it would continue the prompt, e.g.
        with its leading space. One ChoiceScores per row."""
        if len(prompts) != len(choices):
            raise ValueError(f"got {len(prompts)} prompts but {len(choices)} choice lists")
        prompt_ids, choice_ids, failed = [], [], {}
        for i, (p, cs) in enumerate(zip(prompts, choices)):
            try:
                ids = self._tokenize(p)
                cids = [self._continuation(p, ids, c) for c in cs]
            except (TypeError, ValueError) as exc:
                failed[i] = str(exc)
                ids, cids = [], []
            prompt_ids.append(ids)
            choice_ids.append(cids)
        if self.has_unfinished():
            raise RuntimeError("score_choices() called while generation requests are still running")
        scores = score_choices(self.runner, self.cache, prompt_ids, choice_ids, self.config.max_batch_tokens,
                               self.config.max_num_seqs, self.max_model_len, self.prefix_cache)
        self.scheduler.layout = (0, 0)  # scoring laid the pool out its own way
        for i, message in failed.items():
            scores[i] = ChoiceScores([], [], 0, message)
        return scores

    def _continuation(self, prompt: Prompt, prompt_ids: list[int], choice: str | list[int]) -> list[int]:
        """A choice's token ids as they follow the prompt: for text, the tokens that prompt + choice
        has beyond the prompt's own (tokenizers that merge across the boundary or add a prefix
        space agree with how the text would be read); else the choice tokenized on its own."""
        if not isinstance(choice, str):
            return list(choice)
        if isinstance(prompt, str) and choice:
            whole = self.tokenizer.encode(prompt + choice)
            if len(whole) > len(prompt_ids) and whole[: len(prompt_ids)] == prompt_ids:
                return whole[len(prompt_ids):]
        return self.tokenizer.encode_continuation(choice)

    def generate(self, prompts: Seq[Prompt] | Prompt,
                 params: SamplingParams | Seq[SamplingParams] | None = None) -> list[Completion]:
        """Runs every prompt to completion; one Completion per prompt, in input order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        if self.has_unfinished():
            raise RuntimeError("generate() called while requests from add_request() are still running")
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        while self.has_unfinished():
            self.step()
        return [s.to_completion() for s in seqs]
