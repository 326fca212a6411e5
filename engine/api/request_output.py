"""vLLM's offline result types, which `engine.LLM` returns: RequestOutput with its CompletionOutputs
(one per sample), Logprob, and the pooling results' wrappers. Built from the engine's own outputs
(engine.api.outputs), which LLMEngine keeps returning."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.api.outputs import ClassificationOutput, Completion, EmbeddingOutput, ScoringOutput


@dataclass(frozen=True)
class Logprob:
    """One candidate token's log-probability (vLLM's Logprob)."""

    logprob: float
    rank: int | None = None
    """1 = the most probable candidate of its position."""
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sample of a request (vLLM's CompletionOutput)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    """Sum of the chosen tokens' log-probabilities, when logprobs were asked for; else None."""
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    """"stop", "length", or "error" (a request that failed: see `error`)."""
    stop_reason: str | int | None = None
    error: str | None = None
    """Why the sample failed, or how its structured output breaks its constraint (not in vLLM)."""
    lora_request: object | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The result of one prompt (vLLM's RequestOutput)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
    lora_request: object | None = None
    metrics: dict = field(default_factory=dict)


def completion_outputs(c: Completion, decode=None, lora_request=None) -> list[CompletionOutput]:
    """A Completion's samples as vLLM's CompletionOutputs; `decode(token_id) -> str` fills each
    Logprob's decoded_token (None: left empty)."""
    outs = []
    for s in c.samples or [c]:
        logprobs = cumulative = None
        if s.logprobs is not None:
            ranks = s.logprob_ranks or [None] * len(s.logprobs)
            logprobs = [_ranked(p, decode, r) for p, r in zip(s.logprobs, ranks)]
            chosen = [p.get(t) for p, t in zip(s.logprobs, s.token_ids)]
            cumulative = sum(x for x in chosen if x is not None)
        outs.append(CompletionOutput(getattr(s, "index", 0), s.text, list(s.token_ids), cumulative, logprobs,
                                     s.finish_reason, s.stop_reason, s.error, lora_request))
    return outs


def prompt_logprobs_of(c: Completion, decode=None) -> list[dict[int, Logprob] | None] | None:
    """A Completion's prompt logprobs as vLLM returns them: None first, then ranked Logprobs."""
    if c.prompt_logprobs is None:
        return None
    ranks = c.prompt_logprob_ranks or [None] * len(c.prompt_logprobs)
    return [None if p is None else _ranked(p, decode, r) for p, r in zip(c.prompt_logprobs, ranks)]


def _ranked(position: dict[int, float], decode, rank: int | None = None) -> dict[int, Logprob]:
    """A position's entries as Logprobs: the top-N ranked in their order, the chosen or prompt
    token (the first entry, which may lie outside them) at `rank`, its rank in the vocabulary."""
    order = sorted(position, key=position.get, reverse=True)
    token = next(iter(position), None)
    return {t: Logprob(position[t], rank if t == token and rank is not None else order.index(t) + 1,
                       decode(t) if decode else None) for t in position}


@dataclass
class EmbeddingRequestOutput:
    """vLLM's EmbeddingRequestOutput: `outputs.embedding`."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int] | None = None
    finished: bool = True


@dataclass
class ClassificationRequestOutput:
    """vLLM's ClassificationRequestOutput: `outputs.probs`."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int] | None = None
    finished: bool = True


@dataclass
class ScoringRequestOutput:
    """vLLM's ScoringRequestOutput: `outputs.score`."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int] | None = None
    finished: bool = True
