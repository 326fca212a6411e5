"""The check's regexes with a time bound: a schema's `pattern` and `patternProperties` (and the
`regex` constraint's full match) come from rows, and Python's `re` cannot be interrupted, so a
catastrophic pattern such as `^(a+)+$` against 40 a's and a b would hold a worker for hours.
These run through the `regex` package, whose matcher stops at a timeout; one row's regexes
share one deadline (`Deadline`), and a search past it raises RegexTimeout, which the check turns
into that row's violation.

jsonschema calls `re.search` for three keywords; `bounded_validator` gives a validator class
whose `pattern`, `patternProperties` and `additionalProperties` search with the bound, and whose
`unevaluatedProperties` first searches the schema's property patterns against the instance's
keys with the bound (jsonschema then repeats those searches with `re`, which is safe only once
they are known to end quickly).
"""
from __future__ import annotations

import time
from contextvars import ContextVar

import regex

from engine.api.errors import RegexTimeout

REGEX_SECONDS = 1.0
"""Longest one row's check may spend in regexes, in seconds."""

_deadline: ContextVar[float | None] = ContextVar("batchinfer_regex_deadline", default=None)


def _timeout(pattern: str) -> RegexTimeout:
    return RegexTimeout(f"a regex ran past the check's bound of {REGEX_SECONDS:g} s: {pattern[:80]!r}")


class Deadline:
    """`with Deadline():` bounds every search below it to REGEX_SECONDS in all."""

    def __init__(self, seconds: float = REGEX_SECONDS):
        self.seconds = seconds
        self._token = None

    def __enter__(self):
        self._token = _deadline.set(time.monotonic() + self.seconds)
        return self

    def __exit__(self, *exc):
        _deadline.reset(self._token)


def search(pattern: str, text: str, full: bool = False) -> bool:
    """Whether `pattern` matches in `text` (the whole of it if `full`), within the deadline.
    RegexTimeout past it; regex.error for a pattern the regex package cannot read."""
    deadline = _deadline.get()
    timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
    if timeout == 0.0:
        raise _timeout(pattern)
    try:
        compiled = regex.compile(pattern)
        found = compiled.fullmatch(text, timeout=timeout) if full else compiled.search(text, timeout=timeout)
    except TimeoutError:
        raise _timeout(pattern) from None
    return found is not None


def _pattern(validator, patrn, instance, schema):
    from jsonschema.exceptions import ValidationError

    if validator.is_type(instance, "string") and not search(patrn, instance):
        yield ValidationError(f"{instance!r} does not match {patrn!r}")


def _pattern_properties(validator, patterns, instance, schema):
    if not validator.is_type(instance, "object"):
        return
    for patrn, subschema in patterns.items():
        for key, value in instance.items():
            if search(patrn, key):
                yield from validator.descend(value, subschema, path=key, schema_path=patrn)


def _extras(instance, schema) -> list:
    """jsonschema's additional properties (not in `properties`, matching no `patternProperties`)."""
    properties = schema.get("properties", {})
    patterns = list(schema.get("patternProperties", {}))
    return [key for key in instance
            if key not in properties and not any(search(p, key) for p in patterns)]


def _additional_properties(validator, aP, instance, schema):
    from jsonschema.exceptions import ValidationError

    if not validator.is_type(instance, "object"):
        return
    extras = _extras(instance, schema)
    if validator.is_type(aP, "object"):
        for extra in extras:
            yield from validator.descend(instance[extra], aP, path=extra)
    elif not aP and extras:
        joined = ", ".join(repr(each) for each in sorted(extras, key=str))
        if "patternProperties" in schema:
            patterns = ", ".join(repr(each) for each in sorted(schema["patternProperties"]))
            yield ValidationError(f"{joined} {'does' if len(extras) == 1 else 'do'} not match any of the "
                                  f"regexes: {patterns}")
        else:
            yield ValidationError(f"Additional properties are not allowed ({joined} "
                                  f"{'was' if len(extras) == 1 else 'were'} unexpected)")


def property_patterns(schema) -> set[str]:
    """Every `patternProperties` pattern anywhere in `schema` (walked without recursion)."""
    found, stack = set(), [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("patternProperties"), dict):
                found.update(k for k in node["patternProperties"] if isinstance(k, str))
            stack.extend(v for k, v in node.items() if isinstance(v, (dict, list)) and k not in ("enum", "const"))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))
    return found


def bounded_validator(cls, schema):
    """`cls` (a jsonschema validator class) with its regex keywords bounded by the row's deadline."""
    import jsonschema

    keywords = {"pattern": _pattern, "patternProperties": _pattern_properties,
                "additionalProperties": _additional_properties}
    original = cls.VALIDATORS.get("unevaluatedProperties")
    if original is not None:
        patterns = sorted(property_patterns(schema))

        def unevaluated_properties(validator, uP, instance, schema_):
            if validator.is_type(instance, "object"):
                for patrn in patterns:  # bounded first: jsonschema's own re.search below then ends quickly
                    for key in instance:
                        search(patrn, key)
            yield from original(validator, uP, instance, schema_)

        keywords["unevaluatedProperties"] = unevaluated_properties
    return jsonschema.validators.extend(cls, keywords)
