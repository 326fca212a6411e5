"""Text read from input files, made writable: what a JSON line may hold that UTF-8 cannot."""
from __future__ import annotations

import re

LONE_SURROGATE = re.compile("[\ud800-\udfff]")
"""A UTF-16 surrogate left alone in a str: JSON's \\ud800 escape decodes to one, UTF-8 cannot hold it."""


def without_lone_surrogates(value):
    """A JSON value with every lone surrogate in its strings (keys too) replaced by U+FFFD, as a UTF-8
    decoder replaces what it cannot read: such a row is read, generated and written like any other
    (a pair of surrogates is one character already), and so is an id holding one."""
    if isinstance(value, str):
        return LONE_SURROGATE.sub("\ufffd", value) if LONE_SURROGATE.search(value) else value
    if isinstance(value, dict):
        return {without_lone_surrogates(k): without_lone_surrogates(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_lone_surrogates(v) for v in value]
    return value
