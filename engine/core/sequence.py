"""Request state: one mutable Sequence flows add -> schedule -> run -> finish."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.api.outputs import Completion, Sample
from engine.api.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.models.tokenizer import StopStringChecker

LOGITS_BYTES = 256 * 2**20
"""The float32 logits rows a pass keeps beyond each row's last stay under this size: those of rows
collecting prompt logprobs (the scheduler's collect_tokens, which the engine sets from the
vocabulary) and score_choices' chunks of choice tokens (engine.choice_scoring)."""


def collect_tokens(vocab_size: int) -> int:
    """Prompt tokens whose logits fit LOGITS_BYTES."""
    return max(1, LOGITS_BYTES // (4 * vocab_size))


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One request as the engine tracks it."""

    index: int
    """Position in the caller's request list; results come back in this order."""
    prompt_token_ids: list[int]
    """Tokenized prompt (empty if the prompt was rejected before tokenizing)."""
    params: SamplingParams
    """How to decode this request."""
    seed: int
    """Sampling seed: params.seed, or one the engine drew for it."""
    status: Status = Status.WAITING
    """Where the request is in its life."""
    output_token_ids: list[int] = field(default_factory=list)
    """Generated tokens so far."""
    logprobs: list[dict[int, float]] | None = None
    """Per generated token {id: logprob}, when params.logprobs is set."""
    logprob_ranks: list[int] | None = None
    """Per generated token, its rank in the vocabulary (1 = most probable), with logprobs."""
    finish_reason: str | None = None
    """stop | length | error, once finished."""
    stop_reason: str | int | None = None
    """The stop string or token that ended it."""
    error: str | None = None
    """Why it failed, for finish_reason == "error"."""
    text: str | None = None
    """Output text, set once finished (cut at a stop string when one matched)."""
    first_token_time: float | None = None
    """time.perf_counter() when its first token was sampled."""
    finish_time: float | None = None
    """time.perf_counter() when it finished."""
    stop_checker: "StopStringChecker | None" = None
    """Incremental stop-string search while it runs with stop strings; None otherwise."""
    num_computed_tokens: int = 0
    """Leading tokens of token_ids whose keys and values are in the pool."""
    block_ids: list[int] = field(default_factory=list)
    """The row's block table: pool blocks holding its positions, in order (empty unless running)."""
    block_names: list[bytes] = field(default_factory=list)
    """Chain names of its full blocks computed so far (memo for prefix caching)."""
    num_cached_tokens: int | None = None
    """Prompt tokens found in the prefix cache when the row was first admitted (vLLM's name);
    None until then. A recompute after a preemption does not change it."""
    preemptions: int = 0
    """Times it was preempted (its blocks freed, recomputed later)."""
    sample_index: int = 0
    """Which of its request's n samples this row is."""
    matcher: object | None = None
    """The matcher of a constrained row (engine.structured.grammar.RowMatcher); None otherwise."""
    group: list["Sequence"] = field(default_factory=list)
    """On sample 0: every sample of the request, in order (empty for n = 1)."""
    lora: object | None = None
    """The LoRARequest it runs under (None: the base model)."""
    lora_salt: bytes = b""
    """Digest of its adapter's files: sets its prefix-cache names apart from other adapters'."""
    lora_slot: int | None = None
    """The device slot of its adapter while it runs (engine.core.lora_slots)."""
    bad_words: list[tuple[int, ...]] = field(default_factory=list)
    """The token sequences its params.bad_words ban (engine.sample.token_options)."""
    images: list = field(default_factory=list)
    """Its prompt's images (engine.multimodal.ImageSpan: placeholder positions, digest, pixels), in
    order; empty for a text prompt."""
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """On sample 0 with params.prompt_logprobs: per prompt token so far, {id: logprob} (None first)."""
    prompt_logprob_ranks: list[int | None] | None = None
    """Beside prompt_logprobs: each prompt token's rank in the vocabulary (None first)."""

    @property
    def collects_prompt_logprobs(self) -> bool:
        """Whether it still has prompt logprobs to collect: its prefill then skips the prefix
        cache (a cached block's positions are never computed; engine.sample.prompt_logprobs)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def token_ids(self) -> list[int]:
        """Prompt and output so far: what the row's positions hold."""
        return self.prompt_token_ids + self.output_token_ids if self.output_token_ids else self.prompt_token_ids

    @property
    def named_tokens(self) -> list:
        """What its prefix-cache names are taken over: token_ids, with each image's placeholder
        positions standing for that image's digest (two images never share a block name)."""
        if not self.images:
            return self.token_ids
        tokens: list = list(self.token_ids)
        for image in self.images:
            for start, n in image.runs:
                tokens[start:start + n] = [f"img:{image.digest}"] * n
        return tokens

    def tokens_at(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole list."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_len(self) -> int:
        """KV slots this request may need: prompt + max_tokens."""
        return self.num_prompt_tokens + self.params.max_tokens

    def finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def fail(self, message: str) -> None:
        self.error = message
        self.finish("error")

    def to_sample(self) -> Sample:
        return Sample(index=self.sample_index, text=self.text or "", token_ids=list(self.output_token_ids),
                      finish_reason=self.finish_reason or "error", stop_reason=self.stop_reason,
                      logprobs=self.logprobs, error=self.error, num_cached_tokens=self.num_cached_tokens or 0,
                      logprob_ranks=self.logprob_ranks)

    def to_completion(self) -> Completion:
        samples = self.group or [self]
        return Completion(
            index=self.index,
            text=self.text or "",
            token_ids=list(self.output_token_ids),
            finish_reason=self.finish_reason or "error",
            num_prompt_tokens=self.num_prompt_tokens,
            error=self.error,
            logprobs=self.logprobs,
            stop_reason=self.stop_reason,
            samples=[s.to_sample() for s in samples],
            num_cached_tokens=self.num_cached_tokens or 0,
            prompt_logprobs=self.prompt_logprobs if self.finish_reason != "error" else None,
            logprob_ranks=self.logprob_ranks,
            prompt_logprob_ranks=self.prompt_logprob_ranks if self.finish_reason != "error" else None,
            prompt_token_ids=list(self.prompt_token_ids) if self.images else None,
        )
