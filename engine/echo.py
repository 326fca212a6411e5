"""`builtin:echo`: an engine stand-in that answers at once, for the job runner's scale tests and
for its own tests (an actor holding it starts without importing torch: ~1.8 s against ~8 s).

It has LLMEngine's surface as the job runner uses it (generate, score_choices, tokenizer,
config) and the builtin byte-level tokenizer, but no model: every request gets max_tokens
copies of one fixed token, and every choice the same score per token. So a job over 10^7 rows
measures planning, reading, committing and bookkeeping, not the model.
"""
from __future__ import annotations

from typing import Sequence

from engine.api.config import EngineConfig
from engine.api.outputs import ChoiceScores, Completion
from engine.api.sampling_params import SamplingParams
from engine.models.tokenizer import Tokenizer

ECHO_MODEL = "builtin:echo"
ECHO_TEXT = "x"
"""The text of the fixed token every request generates."""
MAX_MODEL_LEN = 4096
"""Default longest prompt + max_tokens (the builtin tokenizer's model_max_length)."""


class EchoEngine:
    """Instant answers: no forward pass, no batching, results in input order."""

    def __init__(self, config: EngineConfig | None = None):
        from engine.models.builtin import byte_tokenizer

        self.config = config or EngineConfig(model=ECHO_MODEL)
        hf = byte_tokenizer()
        self.tokenizer = Tokenizer(hf)
        self.token_id = self.tokenizer.encode_continuation(ECHO_TEXT)[0]
        self.max_model_len = self.config.max_model_len or MAX_MODEL_LEN

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Completion]:
        if isinstance(prompts, str):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        return [self._complete(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]

    def model_identity(self) -> dict:
        """{"kind", "id"} as LLMEngine.model_identity gives it: the echo engine is its name."""
        return {"kind": "builtin", "id": ECHO_MODEL}

    def score_choices(self, prompts, choices) -> list[ChoiceScores]:
        """Every choice token scores -1, so the shortest choice wins; counts are real."""
        if len(prompts) != len(choices):
            raise ValueError(f"got {len(prompts)} prompts but {len(choices)} choice lists")
        scores = []
        for prompt, row in zip(prompts, choices):
            ids = self._ids(prompt)
            counts = [len(c) if isinstance(c, list) else len(self.tokenizer.encode_continuation(c)) for c in row]
            scores.append(ChoiceScores([-float(n) for n in counts], counts, len(ids)))
        return scores

    def _complete(self, index: int, prompt, sp: SamplingParams) -> Completion:
        try:
            ids = self._ids(prompt)
        except ValueError as exc:
            return Completion(index, "", [], "error", 0, error=str(exc))
        if len(ids) + sp.max_tokens > self.max_model_len:
            return Completion(index, "", [], "error", len(ids),
                              error=f"prompt ({len(ids)} tokens) + max_tokens ({sp.max_tokens}) exceeds "
                                    f"max_model_len ({self.max_model_len})")
        tokens = [self.token_id] * sp.max_tokens
        return Completion(index, ECHO_TEXT * sp.max_tokens, tokens, "length", len(ids))

    def _ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        raise ValueError(f"prompt must be text or token ids, got {type(prompt).__name__}")
