"""What a pooling request asks for (embed, classify, score), with vLLM's names: per-request
`PoolingParams`, and the engine-wide `EngineConfig.pooling` (vLLM's PoolerConfig)."""
from __future__ import annotations

from dataclasses import dataclass

POOLING_TYPES = ("MEAN", "CLS", "LAST")
"""How a row's token states become one vector: their mean, the first token's, the last token's."""
POOLING_TASKS = ("embed", "classify", "score")


@dataclass(frozen=True)
class PoolingParams:
    """How one row is pooled. Invalid values raise ValueError naming the field."""

    dimensions: int | None = None
    """Keep the first N dimensions of the embedding (Matryoshka models only, as their config names them)."""
    normalize: bool | None = None
    """L2-normalise the embedding; None = as the model says (a sentence-transformers Normalize module)."""
    truncate_prompt_tokens: int | None = None
    """Keep only the last N tokens of a row longer than that; None = a row over the model's limit fails."""
    use_activation: bool | None = None
    """classify/score: apply the head's activation (softmax over labels, sigmoid of a single score); None = yes."""

    def __post_init__(self) -> None:
        for name in ("dimensions", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("normalize", "use_activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be true, false or null, got {value!r}")


@dataclass(frozen=True)
class PoolerConfig:
    """EngineConfig.pooling as a checked value: what overrides the model's own pooling."""

    pooling_type: str | None = None
    """MEAN, CLS or LAST; None = the model's (its sentence-transformers Pooling module, else its kind's)."""
    normalize: bool | None = None
    """L2-normalise embeddings; None = the model's (a Normalize module; decoder LMs without one: yes)."""

    @classmethod
    def from_value(cls, value) -> PoolerConfig:
        """From EngineConfig.pooling: None, a mapping of these fields, or a PoolerConfig."""
        if value is None:
            return cls()
        if isinstance(value, PoolerConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"pooling must be a mapping of pooling_type and normalize, got {value!r}")
        unknown = sorted(set(value) - {"pooling_type", "normalize"})
        if unknown:
            raise ValueError(f"pooling: unknown key {unknown[0]!r} (known: pooling_type, normalize)")
        kind = value.get("pooling_type")
        if kind is not None:
            if not isinstance(kind, str) or kind.upper() not in POOLING_TYPES:
                raise ValueError(f"pooling.pooling_type must be one of {', '.join(POOLING_TYPES)}, got {kind!r}")
            kind = kind.upper()
        norm = value.get("normalize")
        if norm is not None and not isinstance(norm, bool):
            raise ValueError(f"pooling.normalize must be true, false or null, got {norm!r}")
        return cls(kind, norm)
