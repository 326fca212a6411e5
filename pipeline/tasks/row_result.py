"""What the task makes of one row: the engine's fields of its output row, as a typed record.

This is the boundary between the task (pipeline.tasks.task_runner) and what is written from it:
the output table (pipeline.tasks.table) and OpenAI Batch lines (pipeline.tasks.openai_batch.responses).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from pipeline.spec import PROMPT_LOGPROBS, SCORE_PREFIX, is_failed

if TYPE_CHECKING:
    from pipeline.tasks.openai_batch.requests import BatchRequest


@dataclass
class RowResult:
    """One row's result. The first fields are output columns of the same name; `ran`, `request`,
    `logprobs`, `samples` and `num_cached_tokens` are not written as columns: they shape the row's
    OpenAI Batch line and, with n > 1 samples, its output rows (one per sample), or are counted in
    the shard's record."""

    generated_text: str = ""
    """The generated text (label tasks that score choices: the chosen label); "" when the row failed."""
    num_prompt_tokens: int = 0
    """Tokens of the prompt as the engine saw it."""
    num_generated_tokens: int = 0
    """Tokens generated (0 for choice scoring)."""
    finish_reason: str = "error"
    """stop | length | error"""
    error: str | None = None
    """Why the row failed, or a note (label_regex did not match); None otherwise."""
    label: str | None = None
    """label and eval tasks: the chosen or parsed label."""
    label_probs: list[float] | None = None
    """Choice scoring: softmax over the choices' summed log-likelihoods."""
    label_logprobs: list[float] | None = None
    """Choice scoring: each choice's summed log-likelihood after the prompt."""
    label_logprobs_per_token: list[float] | None = None
    """Choice scoring: each choice's mean log-likelihood per token."""
    sample_index: int = 0
    """Which of the request's samples this is (the `sample_index` column when sampling.n > 1)."""
    label_fields: dict | None = None
    """label.json_schema: the generated object (its top-level properties), None when the row failed."""
    scores: dict[str, float | None] = field(default_factory=dict)
    """eval: score_<metric> column -> 1.0, 0.0 or None (unscored)."""
    ran: bool = False
    """The engine ran the row: a failure is then a generation error, not an invalid request."""
    request: BatchRequest | None = None
    """The OpenAI Batch request the row came from (input.format openai_batch), else None."""
    logprobs: list[dict[int, float]] | None = None
    """Per generated token, {token id: logprob}, chosen token first, when sampling asked for logprobs."""
    samples: list[RowResult] | None = None
    """A request of n > 1 samples that ran: one result per sample, in sample order (the fields
    above are sample 0's, as in engine.Completion); None otherwise."""
    num_cached_tokens: int = 0
    """Prompt tokens the engine found in its prefix cache for this row (or sample)."""
    embedding: list[float] | None = None
    """task embed: the row's embedding; None when the row failed."""
    class_label: str | None = None
    """task classify: the id2label name of the most probable class."""
    class_probs: list[float] | None = None
    """task classify: the probability of each class, in the model's label order."""
    score: float | None = None
    """task score: the pair's score (a cross-encoder's, or the cosine of two embeddings)."""
    pooled: list | None = None
    """An OpenAI Batch pooling line that ran: the engine's outputs of its inputs, in order."""
    adapter: str | None = None
    """With LoRA: the adapter the row ran under (None: the base model)."""
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """With sampling.prompt_logprobs: per prompt token, {token id: logprob} for it (first) and its top
    alternatives; None for the first token. Its column keeps each prompt token's own logprob."""

    def sample_results(self, n: int = 1) -> list[RowResult]:
        """The results of the row's output rows: its samples, or, for a row that drew none (it
        failed first), `n` copies of itself numbered 0 .. n-1, so every row has n sample rows."""
        if self.samples is not None:
            return self.samples
        return [self] if n == 1 else [replace(self, sample_index=j, scores=dict(self.scores)) for j in range(n)]

    def cached_prompt_tokens(self, per_sample: bool) -> int:
        """Prompt tokens served by the prefix cache, counted as `num_prompt_tokens` is counted:
        per sample row (`per_sample`), or once for the row (an OpenAI Batch line, whose usage
        counts its prompt once). Once for the row is its samples' least: the sample that
        computed the prompt found only what was cached before it, and its siblings read its blocks.
        A line with a failed sample is an error line, with no usage: none."""
        samples = self.samples or [self]
        if per_sample:
            return sum(s.num_cached_tokens for s in samples)
        return 0 if any(s.failed for s in samples) else min(s.num_cached_tokens for s in samples)

    @property
    def failed(self) -> bool:
        """The row counts as an error: it failed, or its structured output is incomplete."""
        return is_failed(self.finish_reason, self.error)

    def column(self, name: str):
        """The value of output column `name`."""
        if name.startswith(SCORE_PREFIX):
            return self.scores.get(name)
        if name == PROMPT_LOGPROBS:
            return None if self.prompt_logprobs is None else [
                None if e is None else next(iter(e.values())) for e in self.prompt_logprobs]
        return getattr(self, name)
