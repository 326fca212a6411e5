"""LLMEngine: takes requests, forms batches, runs them, returns completions in input order."""
from __future__ import annotations

import logging
import random
import time
from typing import Sequence as Seq

import torch

from engine.api.config import EngineConfig
from engine.api.errors import EngineBusy
from engine.api.lora import LoRARequest, per_prompt_lora
from engine.api.outputs import (BatchStats, ChoiceScores, ClassificationOutput, Completion, EmbeddingOutput,
                                ScoringOutput)
from engine.api.prompts import Prompt, per_prompt
from engine.api.protocol import EngineFacts
from engine.api.sampling_params import SamplingParams
from engine.core.block_pool import BlockPool, hash_salt
from engine.core.scheduler import Scheduler, SchedulerOutput, batched_tokens
from engine.core.sequence import Sequence, Status, collect_tokens
from engine.core.stats import StatsCollector
from engine.encoder_engine import NO_LORA, EncoderEngine
from engine.lora.router import AdapterRouter
from engine.models.pooling import read_pooling_info
from engine.models.tokenizer import Tokenizer
from engine.multimodal import ImageInputs, media_policy
from engine.core.paged import PagedPass
from engine.pooling import Pooler
from engine.pooling_calls import PoolingCalls
from engine.prompt_reader import PromptReader
from engine.runner.cuda_graph import graphs_supported
from engine.runner.loader import import_apart
from engine.runner.memory import engine_weights_facts, keep_cpu_buffers, memory_report, model_len, pool_blocks
from engine.runner.model_runner import ModelRunner
from engine.sample.running_rows import RunningRows, Sampled, sample_seed
from engine.sample.finish import finish_rows
from engine.sample.prompt_logprobs import prompt_logprob_rows, collect_prompt_logprobs
from engine.sample.sampler import Sampler
from engine.sample.token_options import bad_word_sequences, check_request
from engine.choice_scoring import choice_rows
from engine.structured import GrammarBackend

log = logging.getLogger(__name__)


def _config(config: EngineConfig | None, overrides: dict) -> EngineConfig:
    if config is not None and overrides:
        raise TypeError("pass either an EngineConfig or keyword overrides, not both")
    return config if config is not None else EngineConfig(**overrides)


def _unfinished(running: RunningRows, scheduler: Scheduler) -> bool:
    """Whether any request is still running or queued."""
    return not running.empty or scheduler.has_work()


class LLMEngine:
    """A single-process generation engine (engine.api.Engine; SteppingEngine).

    >>> llm = LLMEngine(EngineConfig(model="builtin:tiny"))
    >>> outs = llm.generate(["Hello", "Bonjour"], SamplingParams(max_tokens=8, temperature=0))

    The config of an encoder model gives an EncoderEngine (engine.encoder_engine), which pools only.
    """

    def __new__(cls, config: EngineConfig | None = None, **overrides):
        info = read_pooling_info(_config(config, overrides))
        if cls is LLMEngine and info.kind == "encoder":
            return EncoderEngine(_config(config, overrides), info)
        engine = super().__new__(cls)
        engine.pooling_info = info
        """What the model says about embed, classify and score (engine.models.pooling), read once."""
        return engine

    def __init__(self, config: EngineConfig | None = None, **overrides):
        self.config = _config(config, overrides)
        import_apart()  # the modules that keep their importer's frames: never this constructor's
        self.batch_stats: list[BatchStats] = []  # every batch run so far, in order (pooling: one per call)
        self.runner = ModelRunner(self.config)  # self.pooling_info: read by __new__
        if self.runner.device.type == "cpu":
            keep_cpu_buffers()
        try:
            self._prepare()
        except BaseException:
            self.runner.close()  # the ranks of an engine that never was
            raise
        self.pool = BlockPool(self.cache.num_blocks, self.block_size, caching=self.config.enable_prefix_caching)
        self.adapters = AdapterRouter(self.runner, self.config.max_loras,
                                      None if self.runner.lora is not None else NO_LORA)
        """LoRA: requests' adapters checked, their device slots filled before each pass."""
        self.salt = hash_salt(self.config.model, self.config.revision, str(self.runner.dtype),
                              str(self.runner.kv_dtype), self.runner.quantization)
        """Roots the prefix-cache names: blocks of another model, revision or dtype never match."""
        longrope = self.runner.longrope
        self.scheduler = Scheduler(self.pool, self.config.max_num_seqs, self.max_model_len,
                                   self.max_num_batched_tokens, self.continuous, self.salt,
                                   long_rope_after=longrope.original if longrope is not None else None,
                                   lora_slots=self.adapters.slots)
        self.scheduler.collect_tokens = collect_tokens(self.runner.vocab_size)
        self.running = RunningRows(self.tokenizer, self.runner.device, self.runner.vocab_size, self.config.max_num_seqs)
        self.stats = StatsCollector()
        """Figures of the batch running now; closed ones go to batch_stats."""
        self.sampler = Sampler(self.runner.vocab_size, self.runner.device)
        self.grammar = GrammarBackend(self.runner.hf_tokenizer, self.runner.vocab_size, self.tokenizer.eos_token_ids,
                                      backend=config.structured_outputs_backend,
                                      paths=getattr(self.runner, "paths", None))
        """Structured outputs: grammars compiled once per constraint, matchers per constrained row."""
        self._seed_rng = random.Random(self.config.seed)
        self._next_index = 0
        self._prompt_logprobs = False  # some request asked for prompt logprobs: passes check for them
        vision = self.runner.vision
        self.images = (ImageInputs(self.runner.model_dir, vision.family, self.runner.model.config,
                                   media_policy(self.config), self.config.limit_mm_per_prompt,
                                   self.config.trust_remote_code, vision.family.rope_index(self.runner.model))
                       if vision is not None else None)
        """A vision-language model's image prompts (engine.multimodal), else None."""
        self.prompts = PromptReader(self.config.model, self.tokenizer, self.runner.vocab_size, self.images)
        """Prompts (text, token ids, image prompts, chat) -> token ids and images."""
        self.paged = PagedPass(self.runner, self.cache, self.pool, self.max_num_batched_tokens, self.max_model_len,
                               self.adapters.stamp, self.scheduler.salt_of)
        """What pooling and choice scoring passes need: the pieces, never this engine."""
        pooler = Pooler(self.pooling_info, self.batch_stats, self.max_model_len, self.max_num_batched_tokens,
                        paged=self.paged)
        running, scheduler = self.running, self.scheduler  # the pieces: nothing below holds the engine
        self.pooling = PoolingCalls(self.pooling_info, pooler, self.adapters,
                                    busy=lambda: _unfinished(running, scheduler))
        """embed, classify and score of a decoder pooling model (engine.pooling_calls)."""

    def _prepare(self) -> None:
        """Tokenizer, limits and KV pool: what can still fail once the runner (and its ranks) started."""
        self.tokenizer = Tokenizer(self.runner.hf_tokenizer, self.runner.eos_token_ids())
        self.max_model_len = model_len(self.runner, self.config)
        self.tokenizer.max_tokens = self.max_model_len
        self.continuous = self.config.scheduling == "continuous"
        self.block_size = self.config.block_size
        self.max_num_batched_tokens = batched_tokens(self.config.max_num_batched_tokens,
                                                     on_cpu=self.runner.device.type != "cuda")
        if graphs_supported(self.runner) and not self.config.enforce_eager and self.runner.head == "causal":
            self.runner.enable_graphs(self.config.max_num_seqs, -(-self.max_model_len // self.block_size))
        self.cache = self.runner.new_cache(pool_blocks(self.runner, self.config, self.block_size,
                                                       self.max_num_batched_tokens, self.max_model_len), self.block_size)
        """The KV pool: allocated on the first forward pass, shared by every row, prefix and score."""

    def refusal(self, task: str) -> str | None:
        """Why this engine cannot run `task` (engine.api.protocol.TASKS); None if it can."""
        return self.pooling_info.refusal("generate" if task in ("score_choices", "step") else task)

    def facts(self) -> EngineFacts:
        """What the manifest, the report and `batchinfer tune` say about this engine."""
        fast_paths, gguf = engine_weights_facts(self.runner)
        return EngineFacts(model=self.config.model, kind="generation", max_model_len=self.max_model_len,
                           pool_tokens=self.pool_tokens, memory=self.memory, device=str(self.runner.device),
                           dtype=str(self.runner.dtype).removeprefix("torch."),
                           max_num_batched_tokens=self.max_num_batched_tokens, fast_paths=fast_paths, gguf=gguf,
                           embedding_width=self.pooling_info.width,
                           lora_slots=self.config.max_loras if self.runner.lora is not None else 0)

    def model_identity(self) -> dict:
        """What identifies the weights this engine runs ({"kind", "id"}: engine.models.identity)."""
        from engine.models import model_identity

        return model_identity(self.config)  # a file is hashed once per node (engine.models.gguf.file_digest)

    def close(self) -> None:
        """Stops the engine's tensor-parallel ranks (if any); idempotent. Garbage collection and
        interpreter exit stop them too."""
        self.runner.close()

    def __enter__(self) -> "LLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def pool_tokens(self) -> int:
        """Token slots of the KV pool (max_batch_tokens as resolved)."""
        return self.pool.num_blocks * self.block_size

    @property
    def memory(self) -> dict:
        """The KV pool (blocks, block size, tokens, bytes) and the weights' bytes, for stats,
        manifests and `batchinfer tune`. Pool bytes are computed before its first allocation.
        With tensor_parallel_size N the bytes are rank 0's (its device's share)."""
        return memory_report(self.runner, self.config, self.cache, self.pool)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of the prompt tokens looked up whose blocks were found cached."""
        return self.pool.hit_tokens / self.pool.queried_tokens if self.pool.queried_tokens else 0.0

    # -- requests -----------------------------------------------------------------------------

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    lora_request: LoRARequest | None = None) -> Sequence:
        """Tokenizes and queues one request (its n samples), under a LoRA adapter or the base model
        (None); a request that can never run (its adapter unusable too) is finished with an error.
        Returns sample 0, whose `group` holds all n when n > 1."""
        self.pooling_info.check("generate")
        params = params or SamplingParams()
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        seq = Sequence(index=self._next_index, prompt_token_ids=[], params=params, seed=seed)
        self._next_index += 1
        try:
            seq.prompt_token_ids, seq.images = self.prompts.read(prompt)
            check_request(params, self.runner.vocab_size, self.config.max_logprobs)
            seq.bad_words = bad_word_sequences(self.tokenizer, params.bad_words) if params.bad_words else []
            self.adapters.attach(seq, lora_request)
            if params.structured_outputs is not None:
                self.grammar.compile(params.structured_outputs)
            if params.prompt_logprobs is not None:
                seq.prompt_logprobs, seq.prompt_logprob_ranks = [None], [None]
                self._prompt_logprobs = True
        except (TypeError, ValueError) as exc:
            seq.fail(str(exc))
            return seq
        samples = [seq] + [Sequence(index=seq.index, prompt_token_ids=seq.prompt_token_ids, params=params,
                                    seed=sample_seed(seed, j), sample_index=j, lora=seq.lora, lora_salt=seq.lora_salt,
                                    bad_words=seq.bad_words, images=seq.images)
                          for j in range(1, params.n)]
        if params.n > 1:
            seq.group = samples
        for s in samples:
            if params.structured_outputs is not None:
                self.grammar.start(s)
            self.scheduler.add(s)
        return seq

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Text or token ids -> the token ids the model reads (ValueError or TypeError in one line)."""
        return self.prompts.tokenize(prompt)

    def encode_chat(self, messages: list[dict]) -> list[int] | dict:
        """A conversation as add_request takes it (engine.prompt_reader.PromptReader.encode_chat)."""
        return self.prompts.encode_chat(messages)

    def chat_image_prompt(self, converted: list[dict], sources: list, **template_kwargs) -> dict:
        """The image prompt of a conversation (engine.prompt_reader.PromptReader.chat_image_prompt)."""
        return self.prompts.chat_image_prompt(converted, sources, **template_kwargs)

    def has_unfinished(self) -> bool:
        return _unfinished(self.running, self.scheduler)

    def abort(self, reason: str = "aborted") -> list[Sequence]:
        """Ends every unfinished request with finish_reason "error" and `reason` as its error, and
        gives its blocks back to the pool, so the engine takes new requests. `generate` calls it
        when a pass raises (out of memory in a pass of decoding rows, a tensor-parallel rank lost,
        Ctrl-C) before the exception goes on. Returns the requests it ended."""
        self.running.remove(list(self.running.seqs))
        self.stats.drop()
        seqs = self.scheduler.abort()
        for seq in seqs:
            if seq.status is not Status.FINISHED:
                seq.fail(reason)
        return seqs

    # -- the loop -----------------------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """One forward pass: schedule -> run -> postprocess. The pass carries every running
        row's next token and prefill chunks of rows still reading their prompts. Returns the
        sequences that finished in it."""
        step = self._schedule()
        if step.is_empty:
            return []
        sampled = self._run(step)
        finished = self._postprocess(sampled) if sampled is not None else []
        self._close_batch()
        return finished

    def _schedule(self) -> SchedulerOutput:
        """The next step; the running table follows it (preempted rows leave, admitted join)."""
        step = self.scheduler.schedule()
        self.adapters.load_pending()
        self.running.remove(step.preempted)
        if step.admitted:
            self.stats.join(step.admitted, self.running.num_rows)
            self.running.join(step.admitted)
        return step

    def _run(self, step: SchedulerOutput) -> Sampled | None:
        """Runs the step's forward pass and samples the next tokens on the device (None: the
        pass ran out of memory and its prefills were requeued)."""
        prompt_lp = prompt_logprob_rows(step.chunks) if self._prompt_logprobs else None
        try:
            logits = self.runner.run(self.cache, step.chunks, keep=None if prompt_lp is None else prompt_lp.keep)
        except torch.OutOfMemoryError as exc:
            self._out_of_memory(step, exc)
            return None
        if prompt_lp is not None:
            collect_prompt_logprobs(prompt_lp, logits)
            logits = logits[prompt_lp.sampling] if prompt_lp.sampling else None
        self.scheduler.update(step)
        self.stats.count_pass(step, self.pool.num_used * self.block_size)
        seqs = [c.seq for c in step.chunks if c.samples]
        if not seqs:
            return None
        rows = self.running.rows(seqs)
        if any(s.matcher is not None for s in seqs):
            self.grammar.apply(logits, seqs)
        tokens, logprobs = self.sampler(logits, **self.running.sampler_inputs(rows, seqs))
        return Sampled(seqs, rows, tokens, logprobs)

    def _postprocess(self, sampled: Sampled) -> list[Sequence]:
        """Records the sampled tokens on the host and finishes the rows that are done."""
        finished = self.running.append_tokens(sampled.seqs, sampled.rows, sampled.tokens, sampled.logprobs)
        constrained = [s for s in sampled.seqs if s.matcher is not None]
        if constrained:
            self.grammar.stop_whole_at_length(finished)
            finished += self._grammar_complete([s for s in constrained if s.finish_reason is None])
            self.grammar.check(finished)
        self.scheduler.finish(finished)
        self.running.remove(finished)
        self.stats.finish(finished)
        for seq in finished:  # its images' pixels (its samples share them: kept while any runs)
            if seq.images and seq.params.n == 1:
                for span in seq.images:
                    span.pixels = None
        return finished

    def _close_batch(self) -> None:
        """A drained table closes its batch's statistics: when no work is left, or in static
        mode whenever one batch has drained."""
        if self.running.empty and self.stats.open and (not self.continuous or not self.scheduler.has_work()):
            self.batch_stats.append(self.stats.close())

    def _grammar_complete(self, seqs: list[Sequence]) -> list[Sequence]:
        """Constrained rows whose grammar is complete stop there (also with ignore_eos)."""
        done = self.grammar.accept(seqs)
        if done:
            finish_rows(self.tokenizer, done, time.perf_counter())
            for seq in done:
                if seq.finish_reason != "stop":
                    seq.finish("stop", seq.stop_reason)
        return done

    def _out_of_memory(self, step: SchedulerOutput, exc: Exception) -> None:
        """A pass ran out of device memory. Its prefill rows go back to the queue (recomputed
        later) and later passes carry half the tokens; the pool is untouched (nothing of the
        failed pass was named, so no cached block holds half-written keys and values). A pass of
        decoding rows alone re-raises: the caller's remedy is a smaller pool."""
        chunked = [c.seq for c in step.chunks if c.count > 1]
        if not chunked or self.scheduler.max_num_batched_tokens <= self.config.max_num_seqs:
            raise exc
        log.warning("out of memory in a pass of %d tokens: its %d prefill rows are requeued and passes now carry "
                    "at most %d tokens", step.num_tokens, len(chunked), self.scheduler.max_num_batched_tokens // 2)
        self.scheduler.max_num_batched_tokens = max(self.config.max_num_seqs, self.scheduler.max_num_batched_tokens // 2)
        for seq in chunked:
            self.scheduler.preempt(seq)
        self.running.remove(chunked)
        self.runner.release_cached_memory()

    def generate(self, prompts: Seq[Prompt] | Prompt, params: SamplingParams | Seq[SamplingParams] | None = None,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[Completion]:
        """Runs every prompt to completion; one Completion per prompt, in input order. lora_request:
        one adapter for all prompts, one per prompt (None: the base model); rows of different
        adapters share passes."""
        prompts, params = per_prompt(prompts, params, SamplingParams)
        loras = per_prompt_lora(lora_request, len(prompts))
        self.pooling_info.check("generate")
        if self.has_unfinished():
            raise EngineBusy("generate() called while requests from add_request() are still running")
        try:  # whatever one request or pass raises, the engine is left with nothing of this call's
            seqs = [self.add_request(p, sp, lr) for p, sp, lr in zip(prompts, params, loras)]
            while self.has_unfinished():
                self.step()
        except BaseException as exc:
            self.abort(f"generation stopped: {type(exc).__name__}")
            raise
        return [s.to_completion() for s in seqs]

    # -- calls that sample nothing --------------------------------------------------------------

    def score_choices(self, prompts: Seq[Prompt], choices: Seq[Seq[str | list[int]]],
                      lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[ChoiceScores]:
        """Log-likelihood of each choice after its row's prompt: choices[i] are the candidates for
        prompts[i]. A text choice after a text prompt is tokenized as part of prompt + choice (its
        tokens are those beyond the prompt's), so write it as it would continue the prompt, e.g.
        with its leading space. One ChoiceScores per row; rows of each adapter (lora_request: one
        for all rows or one per row) are scored together."""
        self.pooling_info.check("generate")
        if len(prompts) != len(choices):
            raise ValueError(f"got {len(prompts)} prompts but {len(choices)} choice lists")
        rows = choice_rows(self.prompts, prompts, choices)
        if self.has_unfinished():
            raise EngineBusy("score_choices() called while generation requests are still running")
        return rows.score(self.paged, self.adapters, per_prompt_lora(lora_request, len(prompts)))

    def embed(self, prompts: Seq[Prompt] | Prompt, pooling_params=None, lora_request=None) -> list[EmbeddingOutput]:
        """One embedding per prompt (text or token ids), in input order; a bad row gets its error."""
        return self.pooling.embed(prompts, pooling_params, lora_request)

    def classify(self, prompts: Seq[Prompt] | Prompt, pooling_params=None, lora_request=None) -> list[ClassificationOutput]:
        """Class probabilities (and the most probable id2label name) per prompt, in input order."""
        return self.pooling.classify(prompts, pooling_params, lora_request)

    def score(self, text_1, text_2, pooling_params=None, lora_request=None) -> list[ScoringOutput]:
        """One score per pair (one text_1 for every text_2, or two lists): a cross-encoder's, or a cosine."""
        return self.pooling.score(text_1, text_2, pooling_params, lora_request)
