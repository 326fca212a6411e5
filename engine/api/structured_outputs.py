"""What a constrained request asks for (vLLM's `StructuredOutputsParams`). No torch, no xgrammar:
specs and sampling parameters import it anywhere; `engine.structured` compiles and checks it."""
from __future__ import annotations

import json as _json
from dataclasses import dataclass, fields

KINDS = ("json", "regex", "choice", "grammar", "json_object")
VIOLATION = "structured output "
"""How the error of a finished constrained output that breaks its constraint begins (e.g.
"structured output does not satisfy the schema at $.side_length: ..."): such a row keeps its
finish_reason, and counts as failed wherever errors are counted."""
MAX_SCHEMA_DEPTH = 64
"""Deepest nesting of objects and arrays a JSON Schema may have: jsonschema validates by recursion
and fails past about 100 levels (OpenAI's structured outputs allow 10 levels of objects)."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint on the generated text. Invalid values raise ValueError naming the field."""

    json: dict | str | None = None
    """A JSON Schema, as a dict or as its JSON text: the output is one JSON value it accepts."""
    regex: str | None = None
    """The whole output matches this regular expression."""
    choice: tuple[str, ...] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """An EBNF grammar (GBNF dialect, root rule `root`) the output belongs to."""
    json_object: bool = False
    """The output is any JSON object."""

    def __post_init__(self) -> None:
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", _json.loads(self.json))
            except (ValueError, RecursionError) as exc:
                raise ValueError(f"structured_outputs.json: not JSON text: {exc}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(f"structured_outputs.json must be a JSON Schema object, got {type(self.json).__name__}")
        if isinstance(self.json, dict) and _deeper_than(self.json, MAX_SCHEMA_DEPTH):
            raise ValueError(f"structured_outputs.json is nested deeper than {MAX_SCHEMA_DEPTH} levels of objects "
                             "and arrays, which the check of its outputs cannot follow")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) and c for c in self.choice) \
                    or not self.choice:
                raise ValueError(f"structured_outputs.choice must be a list of non-empty strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be true or false, got {self.json_object!r}")
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: set exactly one of {', '.join(KINDS)}"
                             + (f" (got {', '.join(given)})" if given else ""))

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """The constraint as canonical text: equal constraints compile once."""
        value = getattr(self, self.kind)
        return f"{self.kind}:{_json.dumps(value, sort_keys=True, separators=(',', ':'))}"

    @classmethod
    def coerce(cls, value) -> "StructuredOutputsParams | None":
        """An instance, a dict of its fields, or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {f.name for f in fields(cls)}
            if unknown:
                raise ValueError(f"structured_outputs: unknown keys {sorted(unknown)} (known: {', '.join(KINDS)})")
            return cls(**value)
        raise ValueError(f"structured_outputs must be a StructuredOutputsParams or a dict, got {type(value).__name__}")


def _deeper_than(value, limit: int) -> bool:
    """Whether `value` nests dicts and lists deeper than `limit` (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((v, depth + 1) for v in children if isinstance(v, (dict, list)))
    return False
