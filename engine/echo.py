"""`builtin:echo`: an engine stand-in that answers at once, for the job runner's scale tests and
for its own tests (an actor holding it starts without importing torch: ~1.8 s against ~8 s).

It satisfies the engine protocol (engine.api.protocol.Engine) with the builtin byte-level
tokenizer but no model: every request gets max_tokens copies of one fixed token, and every
choice the same score per token; it pools nothing (refusal names why). So a job over 10^7 rows
measures planning, reading, committing and bookkeeping, not the model.
"""
from __future__ import annotations

from typing import Sequence

from engine.api.config import EngineConfig
from engine.api.errors import ModelLoadError
from engine.api.lora import LoRARequest
from engine.api.outputs import BatchStats, ChoiceScores, Completion
from engine.api.protocol import EngineFacts
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
        self.batch_stats: list[BatchStats] = []  # it runs no batches

    def refusal(self, task: str) -> str | None:
        """generate and score_choices run; pooling and stepping are not the echo engine's."""
        if task in ("generate", "score_choices"):
            return None
        return f"{task}: {ECHO_MODEL} only generates and scores choices (it has no model)"

    def _no_adapters(self, lora_request) -> None:
        requests = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request]
        if any(r is not None for r in requests):
            raise ValueError(f"{ECHO_MODEL} takes no LoRA adapters")

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[Completion]:
        self._no_adapters(lora_request)
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

    def facts(self) -> EngineFacts:
        """Its name and limits: no device, no weights, no KV pool (its record in a part is None)."""
        return EngineFacts(model=self.config.model, kind="echo", max_model_len=self.max_model_len)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The builtin tokenizer's chat template, as token ids."""
        return self.tokenizer.encode_chat(messages)

    def embed(self, prompts, pooling_params=None, lora_request=None):
        raise ModelLoadError(self.refusal("embed"))

    def classify(self, prompts, pooling_params=None, lora_request=None):
        raise ModelLoadError(self.refusal("classify"))

    def score(self, text_1, text_2, pooling_params=None, lora_request=None):
        raise ModelLoadError(self.refusal("score"))

    def close(self) -> None:
        """Nothing to stop."""

    def score_choices(self, prompts, choices, lora_request=None) -> list[ChoiceScores]:
        """Every choice token scores -1, so the shortest choice wins; counts are real."""
        self._no_adapters(lora_request)
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
