"""What a job may ask of any engine: the `Engine` protocol, the `EngineFacts` an engine reports, and
what an engine may lack.

Three engines satisfy it today, built by `engine.build(config)`: the generation engine
(`LLMEngine`: decoders, paged KV pool, sampling; decoder pooling too), the encoder engine
(`EncoderEngine`: BERT-like models, packed passes, pooling only) and `builtin:echo`'s `EchoEngine`
(no model). An engine that is an HTTP client fits the same protocol: it has no tokenizer and no
KV pool, and says so through the same fields.

What each use of an engine is, and what an engine may lack:

    generate, score_choices,       methods every engine has; one it cannot run raises
    embed, classify, score         ModelLoadError, and `refusal(task)` says why in one line before
                                   anything is sent (a typed capability: never a getattr probe)
    step                           add_request / step / has_unfinished / abort (SteppingEngine),
                                   for callers that watch rows one by one (`batchinfer tune`):
                                   `refusal("step")` is None where an engine has them
    encode_chat(messages)          a method: a conversation as `generate` takes it (token ids, an
                                   image prompt). An engine without a tokenizer returns the messages
                                   themselves, which it sends as they are
    tokenizer                      a field: the engine's Tokenizer (it decodes logprob tokens for
                                   OpenAI Batch lines), or None where the engine has none (an HTTP
                                   client, whose server sends its tokens decoded)
    facts()                        what the manifest, the report and `batchinfer tune` say about the
                                   engine: model, device, dtype, quantization, memory, the KV pool's
                                   tokens, batch budget, fast paths, GGUF file, pooling width, LoRA slots
    batch_stats                    a field: the figures of every batch run so far (empty where an
                                   engine runs no batches of its own)
    model_identity(), close()      methods: what identifies the weights; stops the engine's processes
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from engine.api.config import EngineConfig
from engine.api.lora import LoRARequest
from engine.api.outputs import BatchStats, ChoiceScores, ClassificationOutput, Completion, EmbeddingOutput, ScoringOutput
from engine.api.pooling import PoolingParams
from engine.api.prompts import Prompt
from engine.api.sampling_params import SamplingParams

TASKS = ("generate", "score_choices", "embed", "classify", "score", "step")
"""What `Engine.refusal` is asked about: the engine's calls, and stepping (SteppingEngine)."""

RECORD_FIELDS = ("device", "dtype", "quantization", "tensor_parallel_size", "weights_bytes", "kv_blocks", "block_size",
                 "kv_bytes", "kv_cache_dtype", "max_num_batched_tokens", "load_peak_bytes")
"""What a part's record says about the engine that generated it (the manifest's `engines`), in order."""
RANK_FIELDS = ("rank_weights_bytes", "rank_load_peak_bytes")
"""Added to those under tensor parallelism: each rank's weights' bytes and load peak, rank 0 first."""
GGUF_FIELDS = ("file", "digest", "tensor_types")
"""Added, as `gguf`, for a model read from a GGUF file: the file's name, its sha256 and its tensor types."""


@dataclass
class EngineFacts:
    """What an engine says about itself. Every field but `model` and `kind` may be None where an engine
    does not have the thing (the echo engine and HTTP clients load no weights on a device)."""

    model: str
    kind: str
    """generation | encoder | echo (and, later, endpoint)."""
    max_model_len: int
    """Longest prompt + max_tokens a row may have."""
    pool_tokens: int = 0
    """Token slots of the KV pool (max_batch_tokens as resolved); 0 where there is none."""
    memory: dict[str, Any] = field(default_factory=dict)
    """The KV pool (kv_blocks, block_size, kv_tokens, kv_bytes, kv_cache_dtype) and the weights (weights_bytes,
    load_peak_bytes, quantization, tensor_parallel_size, rank_* under tensor parallelism): engine.runner.memory."""
    device: str | None = None
    dtype: str | None = None
    max_num_batched_tokens: int | None = None
    fast_paths: dict[str, Any] | None = None
    """Each fast path's state where the engine took one (engine.runner.fast_paths): checked, or fell back and why."""
    gguf: dict[str, Any] | None = None
    """A model read from a GGUF file: its file, digest and tensor types."""
    embedding_width: int | None = None
    """The model's embedding width before any cut (None: the engine has no hidden states to pool, as echo)."""
    lora_slots: int = 0
    """Adapters one pass can hold at once (0: LoRA off)."""

    def record(self) -> dict[str, Any] | None:
        """The part record's `engine` entry (RECORD_FIELDS, RANK_FIELDS where set, fast_paths and gguf
        where taken); None for an engine without weights on a device."""
        if self.device is None:
            return None
        facts = {"device": self.device, "dtype": self.dtype, "max_num_batched_tokens": self.max_num_batched_tokens,
                 **self.memory}
        out = {k: facts.get(k) for k in RECORD_FIELDS} | {k: facts[k] for k in RANK_FIELDS if k in facts}
        if self.fast_paths:
            out["fast_paths"] = self.fast_paths
        if self.gguf is not None:
            out["gguf"] = {k: self.gguf.get(k) for k in GGUF_FIELDS}
        return out


LoRAArg = LoRARequest | Sequence[LoRARequest | None] | None
"""One adapter for every prompt, one per prompt (None: the base model), or None."""


class Engine(Protocol):
    """What the pipeline, `engine.LLM` and `batchinfer tune` may ask of an engine (engine.build's result)."""

    config: EngineConfig
    tokenizer: Any
    """The engine's Tokenizer (engine.models.tokenizer), or None where it has none (an HTTP client)."""
    batch_stats: list[BatchStats]

    def refusal(self, task: str) -> str | None:
        """Why this engine cannot run `task` (one of TASKS), in one line; None if it can."""

    def generate(self, prompts: Sequence[Prompt] | Prompt, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora_request: LoRAArg = None) -> list[Completion]:
        """One Completion per prompt, in input order; a bad row gets its error, not an exception."""

    def score_choices(self, prompts: Sequence[Prompt], choices: Sequence[Sequence[str | list[int]]],
                      lora_request: LoRAArg = None) -> list[ChoiceScores]:
        """The log-likelihood of each choice after its row's prompt."""

    def embed(self, prompts: Sequence[Prompt] | Prompt,
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              lora_request: LoRAArg = None) -> list[EmbeddingOutput]:
        """One embedding per prompt."""

    def classify(self, prompts: Sequence[Prompt] | Prompt,
                 pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
                 lora_request: LoRAArg = None) -> list[ClassificationOutput]:
        """Class probabilities per prompt."""

    def score(self, text_1: Prompt | Sequence[Prompt], text_2: Prompt | Sequence[Prompt],
              pooling_params: PoolingParams | None = None, lora_request: LoRAArg = None) -> list[ScoringOutput]:
        """One score per pair."""

    def encode_chat(self, messages: list[dict]) -> list[int] | dict | list[dict]:
        """A conversation as `generate` takes it; a ValueError names what cannot be rendered."""

    def facts(self) -> EngineFacts:
        """What the manifest and the report say about this engine."""

    def model_identity(self) -> dict:
        """What identifies the weights this engine runs: {"kind", "id"} (engine.models.identity)."""

    def close(self) -> None:
        """Stops the engine's processes (tensor-parallel ranks, connections); idempotent."""


class SteppingEngine(Engine, Protocol):
    """An engine whose rows can be added and watched pass by pass (`refusal("step")` is None)."""

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, lora_request: LoRARequest | None = None):
        """Queues one request; returns its sequence (engine.core.sequence.Sequence)."""

    def step(self) -> list:
        """One pass; the sequences that finished in it."""

    def has_unfinished(self) -> bool:
        """Whether any request is still queued or running."""

    def abort(self, reason: str = "aborted") -> list:
        """Ends every unfinished request with `reason` as its error."""
