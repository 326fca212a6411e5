"""Which JSON Schema keywords each backend enforces, and the backend `auto` picks per schema.

Measured on xgrammar 0.2 and llguidance 1.9 (tests/engine/test_structured_backends.py holds
each claim): xgrammar approximates without refusing (`oneOf` as `anyOf`, the length of a
patterned string dropped, `not` ignored); llguidance names what it cannot enforce and compiles
the rest. Neither enforces a `format` beyond its pattern (a 31st of April passes both), so
formats are always checked after generation. What a backend drops is checked after generation
(engine.structured.check); `auto` picks the backend that drops nothing, else the one that drops
least (xgrammar on a tie: its compiled grammars are cached and its masks are the cheaper); a
constraint the picked backend refuses goes to the other (engine.structured.grammar).
"""
from __future__ import annotations

from dataclasses import dataclass, field

BACKENDS = ("auto", "xgrammar", "guidance")
"""EngineConfig.structured_outputs_backend's values (vLLM's names)."""

SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
SCHEMA_ONE = ("not", "items", "additionalProperties", "contains", "if", "then", "else", "propertyNames",
              "unevaluatedItems", "unevaluatedProperties", "additionalItems")
"""Keywords whose values are subschemas (by name, in a list, or one), where the walk goes on."""

IGNORED_BY_BOTH = {"uniqueItems": "ignored", "if": "ignored", "then": "ignored", "else": "ignored",
                   "dependentRequired": "ignored", "dependentSchemas": "ignored", "propertyNames": "ignored",
                   "contains": "ignored", "minContains": "ignored", "maxContains": "ignored",
                   "unevaluatedProperties": "ignored", "unevaluatedItems": "ignored", "format": "approximated",
                   "a lookaround in pattern": "ignored", "a $ref outside the schema": "not followed",
                   "not": "ignored"}
LOOSE = {
    "xgrammar": IGNORED_BY_BOTH | {"oneOf": "enforced as anyOf", "allOf": "partly enforced",
                                   "pattern with minLength/maxLength": "enforced without the length",
                                   "format with minLength/maxLength": "enforced without the length",
                                   "multipleOf": "ignored", "minProperties": "ignored", "maxProperties": "ignored"},
    "guidance": IGNORED_BY_BOTH,
}
"""Per backend: the schema features it does not enforce, and what it does with them instead."""

LOOKAROUND = ("(?=", "(?!", "(?<=", "(?<!")


def schema_features(schema) -> set[str]:
    """The keywords (and combinations of them, named as in LOOSE) that `schema` uses anywhere."""
    found: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        found.update(k for k in node if isinstance(k, str))
        lengths = "minLength" in node or "maxLength" in node
        if "pattern" in node:
            if lengths:
                found.add("pattern with minLength/maxLength")
            if isinstance(node["pattern"], str) and any(a in node["pattern"] for a in LOOKAROUND):
                found.add("a lookaround in pattern")
        if "format" in node and lengths:
            found.add("format with minLength/maxLength")
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) < 2:
            found.discard("allOf")  # one branch is the branch itself
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            found.add("a $ref outside the schema")
        for key in SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack.extend(node[key].values())
        for key in SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack.extend(node[key])
        for key in SCHEMA_ONE:
            value = node.get(key)
            stack.extend(value if isinstance(value, list) else [value])
    return found


@dataclass(frozen=True)
class Route:
    """The backend a constraint runs on, and what that backend leaves to the check after generation."""

    backend: str
    loose: dict = field(default_factory=dict)
    """Feature -> what the backend does with it instead of enforcing it."""
    refused: str | None = None
    """With `auto`: why the backend picked first refused the constraint (this is the other one)."""

    def note(self) -> str:
        """One line for preflight: e.g. "xgrammar; oneOf is enforced as anyOf; outputs are validated
        after generation"."""
        other = next(b for b in BACKENDS[1:] if b != self.backend)
        head = self.backend + (f" ({other} refused it: {self.refused})" if self.refused else "")
        if not self.loose:
            return f"{head} enforces every keyword; outputs are validated after generation"
        said = ", ".join(f"{k} is {how}" for k, how in sorted(self.loose.items()))
        return f"{head}; {said}; outputs are validated after generation"


def route(schema, requested: str, guidance_ok: bool = True) -> Route:
    """The backend for a JSON Schema constraint (`schema` None: a regex, a choice or a grammar,
    which run on xgrammar unless guidance is asked for)."""
    if requested not in BACKENDS:
        raise ValueError(f"structured_outputs_backend must be one of {', '.join(BACKENDS)}, got {requested!r}")
    used = schema_features(schema) if schema is not None else set()

    def loose(name: str) -> dict:
        return {k: v for k, v in LOOSE[name].items() if k in used}

    if requested != "auto":
        return Route(requested, loose(requested))
    if schema is None or not guidance_ok:
        return Route("xgrammar", loose("xgrammar"))
    x, g = loose("xgrammar"), loose("guidance")
    return Route("guidance", g) if len(g) < len(x) else Route("xgrammar", x)
