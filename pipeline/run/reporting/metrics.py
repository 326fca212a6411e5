"""metrics.json (task eval): streaming aggregates over the committed per-row scores.

After the job, `MetricsAccumulator` streams over the committed parts, one table at a time,
keeping only counts: memory grows with the number of groups, never with rows, and a resumed job
reports exactly what an uninterrupted one would.

Every metric is 0/1 per row, so an aggregate is just (count, sum) and its 95% confidence
interval is the Wilson score interval, computed from those two numbers. Sums of 0/1 values
are exact in floating point, so the result does not depend on the order parts are read in.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.spec import check_metric_names, score_column
from pipeline.tasks import group_key

if TYPE_CHECKING:
    from pipeline.io import OutputDir


class SampleMetrics(Protocol):
    """With n > 1 samples per input row, their pass@k and maj@n accumulator
    (pipeline.run.reporting.sample_metrics.SampleMetrics; named here, not imported: that module builds on this one)."""

    n: int

    def add(self, table: pa.Table) -> None: ...

    def merge(self, other: SampleMetrics) -> None: ...

    def result(self) -> dict: ...


WILSON_Z = 1.959963984540054
"""The standard normal quantile for a two-sided 95% interval."""

DECIMALS = 6
"""mean and ci95 bounds in metrics.json are rounded to this many decimals (counts and sums are exact)."""


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

    def __init__(self, metrics: Sequence[str], group_column: str | None = None, samples: SampleMetrics | None = None):
        """`samples`: with n > 1 samples per input row, their pass@k and maj@n accumulator."""
        check_metric_names(metrics)
        self.metrics = list(metrics)
        self.group_column = group_column
        self.samples = samples
        self.rows = 0
        self.tallies = {m: _Tally() for m in self.metrics}
        self.group_rows: dict[str, int] = {}
        self.group_tallies: dict[str, dict[str, _Tally]] = {}

    def add(self, table: pa.Table) -> None:
        """Adds the rows of one table (e.g. one committed part)."""
        scores = {m: self._score_array(table, m) for m in self.metrics}
        groups = self._group_counts(table, scores) if self.group_column is not None else []
        if self.samples is not None:
            self.samples.add(table)
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
        if self.samples is not None:
            self.samples.merge(other.samples)
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
        result = {"rows": self.rows,
                  "metrics": {m: t.result() for m, t in self.tallies.items()},
                  "group_column": self.group_column,
                  "groups": groups}
        if self.samples is not None:  # n > 1: input rows, and each metric's pass@k and maj@n beside it
            sampled = self.samples.result()
            result["samples"], result["inputs"] = self.samples.n, sampled["inputs"]
            for m, extra in sampled["metrics"].items():
                result["metrics"][m].update(extra)
            for key, group in sampled["groups"].items():
                groups[key]["inputs"] = group["inputs"]
                for m, extra in group["metrics"].items():
                    groups[key]["metrics"][m].update(extra)
        return result

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


def compute_metrics(tables: Iterable[pa.Table], metrics: Sequence[str], group_column: str | None = None,
                    samples: SampleMetrics | None = None) -> dict:
    """metrics.json content over `tables`, read one at a time (`samples`: pass@k and maj@n)."""
    acc = MetricsAccumulator(metrics, group_column, samples)
    for table in tables:
        acc.add(table)
    return acc.result()


def write_metrics(out: OutputDir, parts: Iterable[dict], metrics: Sequence[str], group_column: str | None,
                  samples: SampleMetrics | None = None, by_adapter: MetricsAccumulator | None = None) -> dict:
    """metrics.json of a complete job, over its committed parts (index entries). Returns what the
    manifest says of it: mean, count and ci95 per metric, and per "<metric> pass@k" / "maj@n".
    `by_adapter` (a LoRA job: grouped by its adapter column) adds `adapters`: the same figures per
    adapter (the base model's under "null"), beside the groups, so one table compares the fine-tunes."""
    acc = MetricsAccumulator(metrics, group_column, samples)
    for p in parts:
        if p["rows"]:  # an empty shard's part has no score columns to read
            table = out.read_part(p["shard"])
            acc.add(table)
            if by_adapter is not None:
                by_adapter.add(table)
    result = acc.result()
    if by_adapter is not None:
        result["adapters"] = by_adapter.result()["groups"]
    out.write_json("metrics.json", result)
    summary = {}
    for name, m in result["metrics"].items():
        summary[name] = {k: m[k] for k in ("mean", "count", "ci95")}
        for extra in (key for key in m if "@" in key):
            summary[f"{name} {extra}"] = {k: m[extra][k] for k in ("mean", "count", "ci95")}
    return summary


def _sum(col: pa.ChunkedArray) -> float:
    total = pc.sum(col).as_py()
    return float(total) if total is not None else 0.0
