"""Per-request sampling settings, with vLLM's field names."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.api.config import _field_docs
from engine.api.structured_outputs import StructuredOutputsParams

MAX_N = 128
"""Most samples one request may ask for (n)."""
MAX_LOGPROBS = 20
"""Most alternatives a token's logprobs may list by default (vLLM's max_logprobs default, EngineConfig's; OpenAI's top_logprobs limit)."""
MAX_LOGPROBS_CAP = 1024
"""Most a request may ask for at all; the engine's max_logprobs bounds it further."""
MAX_INT64 = (1 << 63) - 1
MAX_ENTRIES = {"logit_bias": 4096, "stop": 256, "stop_token_ids": 4096, "bad_words": 4096,
               "allowed_token_ids": 1 << 18}
"""Most entries each list or mapping option may have: a request's options are row input, and each
entry costs every decoding step (OpenAI allows 4 stop strings; the largest vocabularies are 2^18)."""
SAMPLING_EPS = 1e-5
"""A temperature below this samples as greedy (as vLLM does): dividing by it overflows float32."""


@dataclass
class SamplingParams:
    """How one request is decoded. Invalid values raise ValueError naming the field."""

    max_tokens: int = 16
    """Most tokens to generate."""
    min_tokens: int = 0
    """Tokens to generate before EOS or stop_token_ids may end the request."""
    temperature: float = 1.0
    """Softmax temperature; 0 (or below 1e-5) = greedy (argmax)."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 or -1 = all."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p; in (0, 1]."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p x the most likely one; in [0, 1]."""
    seed: int | None = None
    """Seed of this request's sampling; the same seed gives the same tokens in any batch."""
    stop: list[str] = field(default_factory=list)
    """Strings that end the request; the output text stops before the first one."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end the request (besides EOS)."""
    ignore_eos: bool = False
    """Keep generating after EOS, up to max_tokens."""
    repetition_penalty: float = 1.0
    """> 1 discourages tokens seen in the prompt or output (CTRL-style: divides positive logits)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already generated; in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence from the logit of tokens already generated; in [-2, 2]."""
    logprobs: int | None = None
    """Return the log-probability of each generated token and of the top-N alternatives (0 = sampled only; N <= the engine's max_logprobs, 20 by default)."""
    prompt_logprobs: int | None = None
    """Return the log-probability of each prompt token given the tokens before it, and of its top-N alternatives (0 = the prompt token only; N <= max_logprobs); the first token's entry is None. The prompt is then computed, not taken from the prefix cache."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the text."""
    n: int = 1
    """Samples to generate from the prompt (the prompt is computed once); sample j draws from (seed, j)."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON Schema, regex, choice list, EBNF grammar or any JSON object (a dict of those keys works too)."""
    logit_bias: dict[int, float] | None = None
    """Token id -> a bias in [-100, 100] added to its logit before sampling (OpenAI's and vLLM's; -100 all but bans it)."""
    allowed_token_ids: list[int] | None = None
    """Only these token ids may be generated (besides nothing: EOS too must be listed to end early)."""
    bad_words: list[str] = field(default_factory=list)
    """Words never generated, as vLLM bans them: each without its leading spaces, and with one leading space where that gives as many tokens with another first one (the word inside a text), banned as its token sequence (its last token is banned where the output ends with the rest)."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text."""
    spaces_between_special_tokens: bool = True
    """With skip_special_tokens false: a space between a special token and its neighbours in the text."""

    def __post_init__(self) -> None:
        check_sizes({name: getattr(self, name) for name in MAX_ENTRIES})
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        _check_float("temperature", self.temperature, low=0.0)
        if self.temperature < SAMPLING_EPS:
            self.temperature = 0.0
        _check_int("top_k", self.top_k, low=-1)
        _check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_float("min_p", self.min_p, low=0.0, high=1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=MAX_INT64)
        _check_float("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True)
        _check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS_CAP)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS_CAP)
        _check_int("n", self.n, low=1)
        if self.n > MAX_N:
            raise ValueError(f"n must be <= {MAX_N}, got {self.n}")
        self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
        self._check_token_options()
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_INT64 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

    def _check_token_options(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must map token ids to numbers, got {type(self.logit_bias).__name__}")
            bias = {}
            for key, value in self.logit_bias.items():
                token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
                if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                    raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
                _check_float(f"logit_bias[{token}]", value, low=-100.0, high=100.0)
                bias[token] = float(value)
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            ids = list(self.allowed_token_ids)
            if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {self.allowed_token_ids!r}")
            self.allowed_token_ids = ids
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.bad_words = list(self.bad_words or [])
        if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            raise ValueError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
        for name in ("skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")

    def token_ids_used(self) -> list[int]:
        """Every token id the request names (stop_token_ids, logit_bias, allowed_token_ids): the
        engine checks them against its vocabulary."""
        return [*self.stop_token_ids, *(self.logit_bias or {}), *(self.allowed_token_ids or [])]

    @classmethod
    def field_docs(cls) -> dict[str, str]:
        return _field_docs(cls)


def _check_int(name: str, value, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")


def _check_float(name: str, value, low: float, high: float | None = None, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < low or (low_open and value == low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")


def check_sizes(options: dict) -> None:
    """ValueError naming the first option in `options` (field -> value, as given) with more entries
    than MAX_ENTRIES allows; cheap, so row input is checked before anything converts it."""
    for name, limit in MAX_ENTRIES.items():
        value = options.get(name)
        if isinstance(value, (dict, list, tuple)) and len(value) > limit:
            what = "strings" if name in ("stop", "bad_words") else "entries" if name == "logit_bias" else "ids"
            raise ValueError(f"{name} has {len(value)} {what}, over the limit of {limit}")
