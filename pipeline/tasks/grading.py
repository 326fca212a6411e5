"""Grading rows against their references (task: eval): each worker grades its rows and commits them with its part
as float columns `score_<metric>`: 1.0 = correct, 0.0 = wrong, null = unscored (no reference, or
the row itself failed). pipeline.run.reporting.metrics aggregates the committed scores into metrics.json.
"""
from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

from pipeline.spec import METRICS, check_metrics, score_column


# -- normalisation --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Normalizer:
    """How text is normalised before it is compared, applied in this order:

    lowercase: str.lower() (not casefold: "ß" stays "ß").
    remove_punctuation: drop every character of a Unicode punctuation category (P*: ".,!?'\"-()"
        and their non-ASCII forms); symbols such as "$" or "+" are kept.
    strip: trim whitespace at both ends *and* collapse each inner run of whitespace to one
        space, so "a  b\\n" == "a b" (removing punctuation often leaves double spaces).
    """

    strip: bool = True
    lowercase: bool = False
    remove_punctuation: bool = False

    def __call__(self, text: str) -> str:
        if self.lowercase:
            text = text.lower()
        if self.remove_punctuation:
            text = "".join(ch for ch in text if not unicodedata.category(ch).startswith("P"))
        if self.strip:
            text = " ".join(text.split())
        return text

    @classmethod
    def from_options(cls, options: Normalizer | Mapping[str, bool] | None) -> Normalizer:
        """A Normalizer from itself, a mapping of its options (as in a spec), or None (defaults)."""
        if options is None:
            return cls()
        if isinstance(options, Normalizer):
            return options
        unknown = sorted(set(options) - {"strip", "lowercase", "remove_punctuation"})
        if unknown:
            raise ValueError(f"unknown normalisation options: {', '.join(unknown)} "
                             "(known: strip, lowercase, remove_punctuation)")
        for name, value in options.items():
            if not isinstance(value, bool):
                raise ValueError(f"normalisation option {name} must be true or false, got {value!r}")
        return cls(**options)


def normalize(text: str, strip: bool = True, lowercase: bool = False, remove_punctuation: bool = False) -> str:
    """`text` normalised as `Normalizer` describes."""
    return Normalizer(strip, lowercase, remove_punctuation)(text)


# -- per-row scores -------------------------------------------------------------------------------


def score_row(prediction, reference, metric: str, *, normalize_opts: Normalizer | Mapping[str, bool] | None = None,
              answer_regex: str | re.Pattern | None = None) -> float | None:
    """1.0 or 0.0 for one row, or None when the row is unscored.

    prediction: the generated text (for accuracy: the chosen label). None = an error row,
        unscored. A non-string value is compared through str().
    reference: one acceptable answer, or a list/tuple of them (1.0 if any matches). None, an
        empty list or a list of only None = no reference, unscored. Non-string references
        (int, float, bool) are compared through str(); a float with an integral value is
        written as an int first (3.0 -> "3"), because nullable int columns often arrive as floats.
    metric:
        exact_match: normalised prediction == a normalised reference.
        contains: a normalised reference is a substring of the normalised prediction.
        regex_match: the answer is taken from the *raw* prediction with re.search (the first
            match): its first capture group if the regex has groups, else the whole match; then
            compared like exact_match. No match (or an unmatched group) = 0.0.
        accuracy: the same comparison as exact_match, meant for choice tasks where the
            prediction is the chosen label.
    """
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r} (known: {', '.join(METRICS)})")
    references = _references(reference)
    if prediction is None or not references:
        return None
    norm = Normalizer.from_options(normalize_opts)
    text = _as_text(prediction)
    if metric == "regex_match":
        if answer_regex is None:
            raise ValueError("metric regex_match needs an answer_regex")
        text = extract_answer(text, answer_regex)
        if text is None:
            return 0.0
    pred = norm(text)
    refs = [norm(r) for r in references]
    if metric == "contains":
        return 1.0 if any(r in pred for r in refs) else 0.0
    return 1.0 if pred in refs else 0.0


def extract_answer(text: str, answer_regex: str | re.Pattern) -> str | None:
    """The first match of `answer_regex` in `text`: group 1 if the regex has groups, else the
    whole match; None when nothing matches or group 1 did not take part in the match."""
    pattern = _compile(answer_regex)
    match = pattern.search(text)
    if match is None:
        return None
    return match.group(1) if pattern.groups else match.group(0)


def score_columns(predictions: Sequence, references: Sequence, metrics: Sequence[str], *,
                  normalize_opts: Normalizer | Mapping[str, bool] | None = None,
                  answer_regex: str | re.Pattern | None = None) -> dict[str, list[float | None]]:
    """Scores a batch of rows: {"score_<metric>": [1.0 | 0.0 | None per row]} for each metric.

    The same predictions are used for every metric; for accuracy pass the label column (call
    once per prediction source if a job scores both text and labels)."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references")
    check_metrics(metrics, answer_regex)
    norm = Normalizer.from_options(normalize_opts)
    return {score_column(m): [score_row(p, r, m, normalize_opts=norm, answer_regex=answer_regex)
                              for p, r in zip(predictions, references)]
            for m in metrics}


def _references(reference) -> list[str]:
    if reference is None:
        return []
    if isinstance(reference, (list, tuple)):
        return [_as_text(r) for r in reference if r is not None]
    return [_as_text(reference)]


def _as_text(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


@lru_cache(maxsize=32)
def _compile_str(pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"invalid answer_regex {pattern!r}: {exc}") from None


def _compile(pattern: str | re.Pattern) -> re.Pattern:
    if isinstance(pattern, re.Pattern):
        return pattern
    if not isinstance(pattern, str):
        raise ValueError(f"answer_regex must be a string, got {type(pattern).__name__}")
    return _compile_str(pattern)


def group_key(value) -> str:
    """The metrics.json key of a group value: its text as `score_row` compares references
    (str(), integral floats as ints), "null" for None (a string "null" shares that group)."""
    return "null" if value is None else _as_text(value)
