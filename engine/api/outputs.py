"""What the engine hands back: one Completion per request (an EmbeddingOutput, ClassificationOutput
or ScoringOutput per pooling row), and per-batch statistics."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Sample:
    """One of a request's n samples."""

    index: int
    """Which sample (0 .. n-1); sample j's randomness comes from (seed, j)."""
    text: str
    """Generated text (special tokens skipped; cut before a matched stop string)."""
    token_ids: list[int]
    """Generated token ids, including the EOS or stop token that ended the sample."""
    finish_reason: str
    """"stop", "length" or "error"."""
    stop_reason: str | int | None = None
    """The stop string or token id that ended the sample, if any."""
    logprobs: list[dict[int, float]] | None = None
    """Per generated token: {token_id: logprob}, when asked."""
    error: str | None = None
    """Why the sample failed, when finish_reason is "error"; or, with finish_reason "stop", how its
    structured output breaks its constraint (it starts with VIOLATION)."""
    num_cached_tokens: int = 0
    """Prompt tokens this sample found in the prefix cache (a sibling sample that computed the
    prompt first leaves it all cached for the others)."""
    logprob_ranks: list[int] | None = None
    """Beside logprobs: each generated token's rank in the whole vocabulary (1 = the most
    probable), which vLLM's Logprob.rank gives the chosen token."""

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class Completion:
    """The result of one request, returned in input order."""

    index: int
    """Position of the request in the `generate` call."""
    text: str
    """Generated text (special tokens skipped; cut before a matched stop string)."""
    token_ids: list[int]
    """Generated token ids, including the EOS or stop token that ended the request."""
    finish_reason: str
    """"stop" (EOS, stop string or stop token), "length" (max_tokens reached) or "error"."""
    num_prompt_tokens: int
    """Tokens in the prompt as the model saw it (0 when the prompt could not be tokenized)."""
    error: str | None = None
    """Why the request failed, when finish_reason is "error"; or, with finish_reason "stop", how its
    structured output breaks its constraint (it starts with VIOLATION, e.g. "structured output
    does not satisfy the schema at $.side_length: 'side_length' is a required property"); else None."""
    logprobs: list[dict[int, float]] | None = None
    """Per generated token: {token_id: logprob} for the chosen token and the top-N, when asked."""
    stop_reason: str | int | None = None
    """The stop string or token id that ended the request, if any."""
    samples: list[Sample] = field(default_factory=list)
    """All n samples (also for n = 1); the fields above are sample 0's."""
    num_cached_tokens: int = 0
    """Prompt tokens sample 0 found in the prefix cache when first admitted (vLLM's name)."""
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """With SamplingParams.prompt_logprobs: per prompt token, {token_id: logprob} for it and its
    top-N alternatives given the tokens before it; the first token's entry is None (vLLM's)."""
    logprob_ranks: list[int] | None = None
    """Beside logprobs: each generated token's rank in the whole vocabulary (1 = the most
    probable), which vLLM's Logprob.rank gives the chosen token."""
    prompt_logprob_ranks: list[int | None] | None = None
    """Beside prompt_logprobs: each prompt token's rank in the vocabulary (None first)."""
    prompt_token_ids: list[int] | None = None
    """An image prompt's token ids as the model saw them (each image's placeholders expanded by
    its processor); None for other prompts, whose ids the caller has or the tokenizer gives."""

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class BatchStats:
    """What one batch cost, so the token budget can be checked and padding measured.

    A batch lasts from its first row joining until it is empty again: one static batch, or in
    continuous mode every request of a `generate` call."""

    rows: int
    """Requests that went through the batch."""
    max_prompt_len: int
    """Longest prompt."""
    max_new_tokens: int
    """Largest max_tokens among the rows."""
    reserved_tokens: int
    """Most KV tokens in use at once: blocks held by running rows x block_size; <= the pool's tokens."""
    prompt_tokens: int
    """Real (unpadded) prompt tokens."""
    padded_prompt_tokens: int
    """Prompt tokens computed by prefill chunks (no padding: equal to prompt_tokens less cached ones, plus recomputes)."""
    cached_prompt_tokens: int = 0
    """Prompt tokens whose keys and values came from the prefix cache instead of a forward pass
    (at each row's first admission: a recompute after a preemption does not count again, so this
    never exceeds prompt_tokens)."""
    peak_rows: int = 0
    """Most rows running at once; <= max_num_seqs."""
    prefill_steps: int = 0
    """Forward passes that brought new rows in."""
    generated_tokens: int = 0
    """Tokens kept in the outputs."""
    decode_steps: int = 0
    """Forward passes after the prefill."""
    computed_rows: int = 0
    """Row-steps computed in decode (finished rows leave at once, so these are all live)."""
    preemptions: int = 0
    """Rows preempted (blocks freed, recomputed later) because the pool ran out."""
    seconds: float = 0.0
    """Wall time of the batch, prefill to last token."""

    @property
    def prefix_hit_rate(self) -> float:
        """Share of prompt tokens served by the prefix cache."""
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


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
    num_cached_tokens: int = 0
    """Prompt tokens found in the prefix cache (the choices share the prompt's blocks: none
    of them reads it again)."""


@dataclass
class EmbeddingOutput:
    """One row's embedding (`embed`), in input order."""

    embedding: list[float]
    """The pooled vector (normalised and cut to `dimensions` as asked); [] when the row failed."""
    num_prompt_tokens: int
    """Tokens the model read (after truncate_prompt_tokens); 0 when the row could not be tokenized."""
    error: str | None = None
    """Why the row failed; else None."""
    prompt_token_ids: list[int] | None = field(default=None, repr=False)
    """The token ids the model read; None when the row could not be tokenized."""


@dataclass
class ClassificationOutput:
    """One row's class probabilities (`classify`), in input order."""

    probs: list[float]
    """One per label, in the model's label order (softmax; raw logits with use_activation=False)."""
    label: str | None
    """The id2label name of the most probable label; None when the row failed."""
    num_prompt_tokens: int = 0
    """Tokens the model read."""
    error: str | None = None
    """Why the row failed; else None."""
    prompt_token_ids: list[int] | None = field(default=None, repr=False)
    """The token ids the model read; None when the row could not be tokenized."""


@dataclass
class ScoringOutput:
    """One pair's score (`score`), in input order."""

    score: float | None
    """A cross-encoder's sigmoid score, or the cosine similarity of two embeddings; None when the pair failed."""
    num_prompt_tokens: int = 0
    """Tokens the model read for the pair."""
    error: str | None = None
    """Why the pair failed; else None."""
