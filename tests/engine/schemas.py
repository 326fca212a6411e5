"""A corpus of JSON Schemas for structured-output tests: what labeling jobs ask for."""
from __future__ import annotations

S, I, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def obj(props: dict, required=None, **kw) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False, **kw}


SCHEMAS = [
    obj({"label": {"enum": ["positive", "negative", "neutral"]}}),
    obj({"sentiment": {"enum": ["pos", "neg"]}, "score": {"type": "integer", "minimum": 0, "maximum": 10}}),
    obj({"ok": B}),
    obj({"n": {"type": "integer", "minimum": -5, "maximum": 5}}),
    obj({"x": {"type": "number", "minimum": 0, "maximum": 1}}),
    obj({"name": {"type": "string", "maxLength": 8}}),
    obj({"code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}}),
    obj({"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}}),
    obj({"ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 4}}),
    obj({"pair": {"type": "array", "prefixItems": [I, B], "items": False}}),
    obj({"inner": obj({"a": I, "b": {"enum": ["x", "y"]}})}),
    obj({"outer": obj({"mid": obj({"leaf": B})})}),
    obj({"a": I, "b": {"type": "string", "maxLength": 4}}, required=["a"]),
    obj({"opt1": B, "opt2": B}, required=[]),
    obj({"kind": {"const": "fixed"}, "v": I}),
    obj({"v": {"anyOf": [I, B]}}),
    obj({"v": {"anyOf": [{"enum": ["none"]}, obj({"k": I})]}}),
    {"$defs": {"item": obj({"id": I, "ok": B})}, **obj({"items": {"type": "array", "items": {"$ref": "#/$defs/item"},
                                                               "maxItems": 2}})},
    {"$defs": {"lab": {"enum": ["spam", "ham"]}}, **obj({"label": {"$ref": "#/$defs/lab"}})},
    obj({"topics": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 2, "maxItems": 2}}),
    obj({"rating": {"type": "integer", "enum": [1, 2, 3, 4, 5]}}),
    obj({"p": {"type": "number"}, "q": {"type": "integer"}}),
    obj({"null_or_int": {"type": ["integer", "null"]}}),
    obj({"email_ish": {"type": "string", "pattern": "^[a-z]{1,5}@[a-z]{1,5}\\.com$"}}),
    obj({"yes": B, "why": {"type": "string", "maxLength": 12}}),
    obj({"matrix": {"type": "array", "items": {"type": "array", "items": {"enum": [0, 1]}, "minItems": 2,
                                                "maxItems": 2}, "minItems": 1, "maxItems": 2}}),
    obj({"lang": {"enum": ["en", "fr", "de"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}}),
    obj({"entities": {"type": "array", "items": obj({"t": {"enum": ["PER", "ORG"]}, "s": {"type": "string",
                                                                                          "maxLength": 5}}),
                      "maxItems": 2}}),
    obj({"version": {"type": "string", "pattern": "^v[0-9]\\.[0-9]$"}, "stable": B}),
    obj({"count": {"type": "integer", "minimum": 0, "maximum": 1000}, "unit": {"enum": ["ms", "s"]}}),
    {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 3},
    {"enum": ["alpha", "beta"]},
]

FINDINGS = {
    "anyOf with not": {"type": "object", "properties": {"a": I, "b": S}, "required": ["a"],
                       "anyOf": [{"not": {"required": ["b"]}}, {"required": ["b"]}]},
    "required in oneOf branches": {"oneOf": [
        {"type": "object", "properties": {"shape": {"const": "square"}, "side_length": N},
         "required": ["shape", "side_length"], "additionalProperties": False},
        {"type": "object", "properties": {"shape": {"const": "circle"}, "radius": N},
         "required": ["shape", "radius"], "additionalProperties": False}]},
    "format date-time": obj({"at": {"type": "string", "format": "date-time"}}),
    "pattern with maxLength": obj({"name": {"type": "string", "maxLength": 6, "pattern": "^[a-z]+$"}}),
    "format with maxLength": obj({"mail": {"type": "string", "format": "email", "maxLength": 12}}),
    "a number": obj({"x": N}),
    "a string": obj({"s": S}),
}
"""The schemas of issue 33's findings: each once passed an invalid output off as a success."""


def real_world_schemas() -> dict[str, dict]:
    """tests/engine/data/schemas (JSONSchemaBench's public schemas; SOURCES.md names each one's
    source and license), by file name."""
    import json
    from pathlib import Path

    folder = Path(__file__).parent / "data" / "schemas"
    return {p.name: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}
