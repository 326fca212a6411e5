"""The check of every finished constrained output: what the grammar let through is parsed and
validated again, so an output that breaks its constraint never passes as a success.

A JSON Schema is validated with `jsonschema` (the validator of the schema's draft, compiled once
per schema, formats checked); JSON must be strict (no NaN or Infinity), hold no number a double
cannot hold and no lone surrogate escape. A regex must match the whole text, a choice be one
of the choices, a grammar be accepted by the row's matcher. A violation is one line starting
with VIOLATION, naming where and why: the row keeps its finish_reason and gets it as its error.
"""
from __future__ import annotations

import json
import math
import re

import regex

from engine.api.errors import ConstraintError, RegexTimeout
from engine.api.structured_outputs import VIOLATION, StructuredOutputsParams
from engine.structured.bounded_regex import Deadline, bounded_validator, search

MESSAGE_CHARS = 200
"""Longest cause a violation quotes (the rest is cut with '...')."""


def _short(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= MESSAGE_CHARS else text[: MESSAGE_CHARS - 3] + "..."


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


class OutputCheck:
    """The check of one constraint, built once and used for each of its rows."""

    def __init__(self, params: StructuredOutputsParams):
        self.kind = params.kind
        self.validator = None
        self.pattern = None
        self.choices = None
        if params.json is not None or params.json_object:
            schema = params.json if params.json is not None else {"type": "object"}
            outside = outside_reference(schema)
            if outside is not None:
                raise ConstraintError(f"structured_outputs.json: {outside}")
            self.validator = _validator(schema)
        elif params.regex is not None:
            try:
                regex.compile(params.regex)
                self.pattern = params.regex
            except regex.error:
                self.pattern = None  # a dialect the regex package does not read: the matcher's verdict stands
        elif params.choice is not None:
            self.choices = frozenset(params.choice)

    def violation(self, text: str, accepted: bool) -> str | None:
        """Why `text` breaks the constraint (one line starting with VIOLATION), or None. `accepted`:
        the row's matcher accepted its whole output. The row's regexes share one time bound."""
        with Deadline():
            try:
                return self._violation(text, accepted)
            except RegexTimeout as exc:
                return f"{VIOLATION}could not be checked: {_short(str(exc))}"

    def _violation(self, text: str, accepted: bool) -> str | None:
        if self.validator is not None:
            return self._json_violation(text)
        if self.choices is not None:
            return None if text in self.choices else f"{VIOLATION}is not one of the choices: {_short(repr(text))}"
        if self.pattern is not None:
            return None if search(self.pattern, text, full=True) else \
                f"{VIOLATION}does not match the regex: {_short(repr(text))}"
        return None if accepted else f"{VIOLATION}is not accepted by the {self.kind}"

    def _json_violation(self, text: str) -> str | None:
        try:
            value = json.loads(text, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:
            return f"{VIOLATION}is not JSON: {_short(exc)}"
        bad = _unholdable(value)
        if bad is not None:
            return bad
        try:
            errors = list(self.validator.iter_errors(value))
        except RegexTimeout:
            raise
        except Exception as exc:  # noqa: BLE001  an unresolvable reference, a schema jsonschema chokes on: this row's
            return f"{VIOLATION}could not be checked against the schema: {_short(type(exc).__name__ + ': ' + str(exc))}"
        if not errors:
            return None
        error = _closest(errors)
        return f"{VIOLATION}does not satisfy the schema at {_where(error)}: {_short(error.message)}"


def _closest(errors: list):
    """The error to report: the most relevant (jsonschema's ranking); for an output that fits no
    branch of a oneOf / anyOf, the error of the branch it came closest to (fewest errors), e.g.
    {"shape": "square"} misses the square's side_length rather than not being a circle."""
    from jsonschema.exceptions import relevance

    error = max(errors, key=relevance)
    while error.context:
        branches: dict = {}
        for sub in error.context:
            branches.setdefault(sub.relative_schema_path[0] if sub.relative_schema_path else 0, []).append(sub)
        error = max(min(branches.values(), key=len), key=relevance)
    return error


DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})
"""Keywords whose values are data, not subschemas: a `$ref` key inside them is not a reference."""
SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
                         "dependencies"})
"""Keywords whose values map names to subschemas: the names are not keywords (a property may be
called `enum`), the values are schemas."""


def outside_reference(schema) -> str | None:
    """Why `schema` is refused, or None: a `$ref` or `$dynamicRef` whose target lies outside the
    document (a URL, a file, another document), which nothing will fetch. Inside are `#...`
    (pointers and anchors) and references to an `$id` the schema itself embeds. Walked without
    recursion, so any depth is read."""
    ids, refs, stack = set(), [], [schema]
    while stack:  # every entry a schema, or a list of schemas; walked by keyword, not by name
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("$ref", "$dynamicRef") and isinstance(value, str):
                    refs.append((key, value))
                elif key == "$id" and isinstance(value, str):
                    ids.add(value.split("#", 1)[0])
                elif key in SCHEMA_MAPS and isinstance(value, dict):
                    stack.extend(v for v in value.values() if isinstance(v, (dict, list)))
                elif key not in DATA_KEYWORDS and isinstance(value, (dict, list)):
                    stack.append(value)
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))
    for key, ref in refs:
        base = ref.split("#", 1)[0]
        if base and base not in ids and not any(i.endswith("/" + base) for i in ids):
            return (f"{key} {_short(repr(ref))} points outside the schema; only references inside it are "
                    "resolved (#/..., anchors, $defs, an $id it embeds), and nothing is fetched")
    return None


def _validator(schema):
    import jsonschema
    from jsonschema.exceptions import SchemaError
    from referencing import Registry

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except SchemaError as exc:
        raise ConstraintError(f"structured_outputs.json: not a valid JSON Schema at "
                              f"{_schema_where(exc)}: {_short(exc.message)}") from None
    except Exception as exc:  # noqa: BLE001  jsonschema choking on a schema (recursion): that constraint's error
        raise ConstraintError(f"structured_outputs.json: could not be read as a JSON Schema: "
                              f"{_short(type(exc).__name__ + ': ' + str(exc))}") from None
    # an empty registry: no reference is ever retrieved (jsonschema's default fetches URLs with urllib)
    # and regexes bounded in time (engine.structured.bounded_regex)
    return bounded_validator(cls, schema)(schema, format_checker=cls.FORMAT_CHECKER, registry=Registry())


def _schema_where(exc) -> str:
    return "/" + "/".join(map(str, exc.path)) if exc.path else "its root"


def _where(error) -> str:
    """The JSON path of a violation; for a missing required property, the property's own path."""
    path = error.json_path
    if error.validator == "required" and isinstance(error.instance, dict):
        missing = next((p for p in error.validator_value if p not in error.instance), None)
        if missing is not None:
            return f"{path}.{missing}" if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(missing)) \
                else f"{path}[{json.dumps(missing)}]"
    return path


def _unholdable(value, path: str = "$") -> str | None:
    """A number a double cannot hold, or a string with a lone surrogate, anywhere in `value`."""
    stack = [(value, path)]
    while stack:
        v, at = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            return f"{VIOLATION}holds a number a double cannot hold at {at}"
        if isinstance(v, int) and not isinstance(v, bool):
            try:
                float(v)
            except OverflowError:
                return f"{VIOLATION}holds a number a double cannot hold at {at}"
        elif isinstance(v, str):
            if _has_surrogate(v):
                return f"{VIOLATION}holds a lone surrogate escape at {at}"
        elif isinstance(v, list):
            stack.extend((x, f"{at}[{i}]") for i, x in enumerate(v))
        elif isinstance(v, dict):
            for k, x in v.items():
                if _has_surrogate(k):
                    return f"{VIOLATION}holds a lone surrogate escape in a key at {at}"
                stack.append((x, f"{at}.{k}"))
    return None


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
