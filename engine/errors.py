"""Errors the engine reports in one line: a model that cannot be loaded, and any exception
shortened to its type and first line."""
from __future__ import annotations


class ModelLoadError(RuntimeError):
    """The model cannot be loaded; the message says why in one line."""


class RankError(RuntimeError):
    """A tensor-parallel rank process died, failed or timed out, and the engine has stopped all
    of its ranks. A retry with a fresh engine can help (a job's worker builds one and redoes the shard)."""


def one_line(exc: BaseException) -> str:
    """`Type: first line of the message`, for one-line error reports."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
