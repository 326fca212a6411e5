"""Eval metrics (task: eval): per-row scores, then streaming aggregates for metrics.json.

Two steps, so that a resumed job reports exactly what an uninterrupted one would:
  1. each worker scores its rows (`score_columns`) and commits them with its part as float
     columns `score_<metric>`: 1.0 = correct, 0.0 = wrong, null = unscored (no reference,
     or the row itself failed);
  2. after the job, `MetricsAccumulator` streams over the committed parts, one table at a
     time, keeping only counts: memory grows with the number of groups, never with rows.

Every metric is 0/1 per row, so an aggregate is just (count, sum) and its 95% confidence
interval is the Wilson score interval, computed from those two numbers. Sums of 0/1 values
are exact in floating point, so the result does not depend on the order parts are read in.
"""
from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING:
    from pipeline.sink import OutputDir

METRICS = ("exact_match", "contains", "regex_match", "accuracy")
"""Metric names a spec may list under eval.metrics."""

SCORE_PREFIX = "score_"
"""Per-row score columns are named SCORE_PREFIX + metric, e.g. score_exact_match."""

WILSON_Z = 1.959963984540054
"""The standard normal quantile for a two-sided 95% interval."""

DECIMALS = 6
"""mean and ci95 bounds in metrics.json are rounded to this many decimals (counts and sums are exact)."""


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


def check_metrics(metrics: Sequence[str], answer_regex: str | re.Pattern | None = None) -> None:
    """Raises ValueError when the metric list or the regex cannot work (a spec error, fatal)."""
    check_metric_names(metrics)
    if "regex_match" in metrics:
        if answer_regex is None:
            raise ValueError("metric regex_match needs an answer_regex")
        _compile(answer_regex)


def check_metric_names(metrics: Sequence[str]) -> None:
    """Raises ValueError unless `metrics` is a non-empty list of known, distinct metric names."""
    if isinstance(metrics, str) or not metrics:
        raise ValueError(f"eval.metrics must be a non-empty list of {', '.join(METRICS)}")
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ValueError(f"unknown metric(s): {', '.join(map(str, unknown))} (known: {', '.join(METRICS)})")
    if len(set(metrics)) != len(metrics):
        raise ValueError(f"eval.metrics lists a metric twice: {list(metrics)}")


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


def score_column(metric: str) -> str:
    """Name of the per-row score column of `metric`."""
    return SCORE_PREFIX + metric


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


# -- aggregation ----------------------------------------------------------------------------------


def wilson_interval(successes: float, count: int, z: float = WILSON_Z) -> tuple[float, float] | None:
    """The Wilson score interval of a proportion successes/count; None when count is 0.

    center = (p + z^2/2n) / (1 + z^2/n),  half = z / (1 + z^2/n) * sqrt(p(1-p)/n + z^2/4n^2)
    """
    if count <= 0:
        return None
    p = successes / count
    z2 = z * z
    denom = 1.0 + z2 / count
    center = (p + z2 / (2 * count)) / denom
    half = z / denom * math.sqrt(p * (1.0 - p) / count + z2 / (4.0 * count * count))
    return max(0.0, center - half), min(1.0, center + half)


@dataclass
class _Tally:
    """count (scored rows), sum (of 0/1 scores), unscored rows, for one metric."""

    count: int = 0
    sum: float = 0.0
    unscored: int = 0

    def add(self, count: int, total: float, unscored: int) -> None:
        self.count += count
        self.sum += total
        self.unscored += unscored

    def result(self) -> dict:
        ci = wilson_interval(self.sum, self.count)
        return {"mean": round(self.sum / self.count, DECIMALS) if self.count else None,
                "count": self.count, "sum": self.sum, "unscored": self.unscored,
                "ci95": [round(ci[0], DECIMALS), round(ci[1], DECIMALS)] if ci else None,
                "ci_method": "wilson"}


class MetricsAccumulator:
    """Streams over committed output tables and produces the metrics.json dict.

    Each table must hold a float column score_<metric> per metric (null = unscored) and, when
    group_column is set, that column. Tables may come in any order; `merge` combines
    accumulators that saw disjoint sets of tables.
    """

    def __init__(self, metrics: Sequence[str], group_column: str | None = None):
        check_metric_names(metrics)
        self.metrics = list(metrics)
        self.group_column = group_column
        self.rows = 0
        self.tallies = {m: _Tally() for m in self.metrics}
        self.group_rows: dict[str, int] = {}
        self.group_tallies: dict[str, dict[str, _Tally]] = {}

    def add(self, table: pa.Table) -> None:
        """Adds the rows of one table (e.g. one committed part)."""
        scores = {m: self._score_array(table, m) for m in self.metrics}
        groups = self._group_counts(table, scores) if self.group_column is not None else []
        # everything is checked above, so a bad table leaves the counts untouched
        self.rows += table.num_rows
        for m, col in scores.items():
            self.tallies[m].add(table.num_rows - col.null_count, _sum(col), col.null_count)
        for row in groups:
            key = group_key(row["key"])
            self._group(key)
            self.group_rows[key] += row["count_all"]
            for m in self.metrics:
                count = row[f"{m}_count"]
                self.group_tallies[key][m].add(count, row[f"{m}_sum"] or 0.0, row["count_all"] - count)

    def merge(self, other: MetricsAccumulator) -> None:
        """Adds the counts of another accumulator with the same metrics and group column."""
        if other.metrics != self.metrics or other.group_column != self.group_column:
            raise ValueError("cannot merge accumulators with different metrics or group columns")
        self.rows += other.rows
        for m, t in other.tallies.items():
            self.tallies[m].add(t.count, t.sum, t.unscored)
        for key, n in other.group_rows.items():
            self._group(key)
            self.group_rows[key] += n
            for m, t in other.group_tallies[key].items():
                self.group_tallies[key][m].add(t.count, t.sum, t.unscored)

    def result(self) -> dict:
        """The metrics.json content: totals, per-metric aggregates and, if grouped, per group
        (groups sorted by key; a null group value is the key "null")."""
        groups = {key: {"rows": self.group_rows[key],
                        "metrics": {m: t.result() for m, t in self.group_tallies[key].items()}}
                  for key in sorted(self.group_rows)}
        return {"rows": self.rows,
                "metrics": {m: t.result() for m, t in self.tallies.items()},
                "group_column": self.group_column,
                "groups": groups}

    def _score_array(self, table: pa.Table, metric: str) -> pa.ChunkedArray:
        name = score_column(metric)
        if name not in table.column_names:
            raise ValueError(f"output has no column {name!r} (columns: {', '.join(table.column_names)})")
        try:
            col = table.column(name).cast(pa.float64())  # JSONL parts may hold null- or int-typed columns
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise ValueError(f"column {name!r} must hold numbers, got {table.column(name).type}: {exc}") from None
        not_01 = pc.sum(pc.cast(pc.invert(pc.is_in(col, pa.array([0.0, 1.0]))), pa.int64())).as_py() or 0
        outside = not_01 - col.null_count  # is_in is false for nulls too
        if outside:
            raise ValueError(f"column {name!r} holds {outside} value(s) other than 0, 1 or null")
        return col

    def _group_counts(self, table: pa.Table, scores: dict[str, pa.ChunkedArray]) -> list[dict]:
        """Per group value of the table: rows (count_all), and <metric>_sum, <metric>_count."""
        if self.group_column not in table.column_names:
            raise ValueError(f"output has no group column {self.group_column!r} "
                             f"(columns: {', '.join(table.column_names)})")
        key_col = table.column(self.group_column)
        if pa.types.is_null(key_col.type):
            key_col = key_col.cast(pa.string())
        aggs = [([], "count_all")] + [a for m in self.metrics for a in ((m, "sum"), (m, "count"))]
        try:
            return pa.table({"key": key_col, **scores}).group_by("key").aggregate(aggs).to_pylist()
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise ValueError(f"group column {self.group_column!r} of type {key_col.type} "
                             f"cannot be grouped: {exc}") from None

    def _group(self, key: str) -> None:
        if key not in self.group_rows:
            self.group_rows[key] = 0
            self.group_tallies[key] = {m: _Tally() for m in self.metrics}


def group_key(value) -> str:
    """The metrics.json key of a group value: its text as `score_row` compares references
    (str(), integral floats as ints), "null" for None (a string "null" shares that group)."""
    return "null" if value is None else _as_text(value)


def compute_metrics(tables: Iterable[pa.Table], metrics: Sequence[str], group_column: str | None = None) -> dict:
    """metrics.json content over `tables`, read one at a time."""
    acc = MetricsAccumulator(metrics, group_column)
    for table in tables:
        acc.add(table)
    return acc.result()


def write_metrics(out: OutputDir, parts: Iterable[dict], metrics: Sequence[str], group_column: str | None) -> dict:
    """metrics.json of a complete job, over its committed parts (index entries). Returns what the
    manifest says of it: mean, count and ci95 per metric."""
    # an empty shard's part has no score columns to read
    result = compute_metrics((out.read_part(p["shard"]) for p in parts if p["rows"]), metrics, group_column)
    out.write_json("metrics.json", result)
    return {name: {k: m[k] for k in ("mean", "count", "ci95")} for name, m in result["metrics"].items()}


def _sum(col: pa.ChunkedArray) -> float:
    total = pc.sum(col).as_py()
    return float(total) if total is not None else 0.0
