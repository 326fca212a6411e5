"""pass@k and maj@n for eval jobs that draw n > 1 samples per input row (metrics.json).

Both are computed per input row from its n sample rows, then averaged over the input rows:

pass@k   the chance that at least one of k samples drawn from the row's n is correct (score 1.0),
         with the unbiased estimator 1 - C(n-c, k) / C(n, k) of Chen et al. 2021 ("Evaluating Large
         Language Models Trained on Code"), c = the row's correct samples. A failed sample is not
         correct. Values are kept as exact fractions, so the sums do not depend on the order parts
         are read in; the 95% interval is the normal one over the per-row values (ci_method "normal").
maj@n    the row's majority answer (self-consistency): each sample that did not fail votes for its
         answer after eval.normalize (regex_match: the answer the regex extracts; accuracy: the
         label), a tie goes to the answer of the lowest sample_index, and the winner is scored
         against the reference like one row (0/1, Wilson interval). No answer at all scores 0.

A row whose samples are all unscored (no reference, or every sample failed) is unscored for both.
Every sample of an input row is in the same committed part (a shard holds whole input rows), so
parts are read one at a time, and memory grows with the groups, never with rows.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

import pyarrow as pa

from pipeline.run.reporting.metrics import DECIMALS, WILSON_Z, _Tally
from pipeline.spec import SAMPLE_INDEX, is_failed, score_column
from pipeline.tasks import Normalizer, extract_answer, group_key, score_row


def pass_at_k(n: int, c: int, k: int) -> Fraction:
    """1 - C(n-c, k) / C(n, k), exactly: of n samples with c correct, the chance that k drawn
    without replacement hold at least one correct sample."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def majority(answers: Sequence[str | None]) -> str | None:
    """The most frequent answer in `answers` (in sample order; None does not vote); a tie goes to
    the answer that comes first. None when nothing voted."""
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return None
    top = max(counts.values())
    return next(a for a in answers if a is not None and counts[a] == top)


@dataclass
class _MeanTally:
    """Exact sums of per-row values in [0, 1] (pass@k), for their mean and normal interval."""

    count: int = 0
    sum: Fraction = Fraction(0)
    squares: Fraction = Fraction(0)
    unscored: int = 0

    def add(self, value: Fraction | None) -> None:
        if value is None:
            self.unscored += 1
            return
        self.count += 1
        self.sum += value
        self.squares += value * value

    def merge(self, other: _MeanTally) -> None:
        self.count += other.count
        self.sum += other.sum
        self.squares += other.squares
        self.unscored += other.unscored

    def result(self) -> dict:
        ci = None
        if self.count >= 2:
            mean = self.sum / self.count
            variance = (self.squares - self.count * mean * mean) / (self.count - 1)
            half = WILSON_Z * math.sqrt(float(variance) / self.count)
            ci = [round(max(0.0, float(mean) - half), DECIMALS), round(min(1.0, float(mean) + half), DECIMALS)]
        return {"mean": round(float(self.sum / self.count), DECIMALS) if self.count else None,
                "count": self.count, "sum": round(float(self.sum), DECIMALS), "unscored": self.unscored,
                "ci95": ci, "ci_method": "normal"}


@dataclass
class _Tallies:
    """One metric's pass@k (per k) and maj@n tallies over input rows."""

    passes: dict[int, _MeanTally]
    majority: _Tally = field(default_factory=_Tally)

    def merge(self, other: _Tallies) -> None:
        for k, t in other.passes.items():
            self.passes[k].merge(t)
        self.majority.add(other.majority.count, other.majority.sum, other.majority.unscored)


class SampleMetrics:
    """Streams over committed output tables of sample rows (id, sample_index, finish_reason, error,
    generated_text, score_<metric>, the reference and group columns, label for accuracy) and
    gives each metric's pass@k and maj@n, in total and per group."""

    def __init__(self, metrics: Sequence[str], n: int, ks: Sequence[int] | None, *, reference_column: str,
                 group_column: str | None = None, normalize: Normalizer | Mapping[str, bool] | None = None,
                 answer_regex: str | None = None):
        self.metrics = list(metrics)
        self.n = n
        self.ks = list(ks) if ks is not None else sorted({1, n})
        self.reference_column = reference_column
        self.group_column = group_column
        self.normalize = Normalizer.from_options(normalize)
        self.answer_regex = answer_regex
        self.inputs = 0
        self.tallies = self._new()
        self.group_inputs: dict[str, int] = {}
        self.group_tallies: dict[str, dict[str, _Tallies]] = {}

    def _new(self) -> dict[str, _Tallies]:
        return {m: _Tallies({k: _MeanTally() for k in self.ks}) for m in self.metrics}

    def add(self, table: pa.Table) -> None:
        """Adds the input rows of one table; every sample of a row must be in it."""
        wanted = ["id", SAMPLE_INDEX, "finish_reason", "error", "generated_text", "label", self.reference_column,
                  self.group_column, *map(score_column, self.metrics)]
        missing = [c for c in (self.reference_column, self.group_column) if c and c not in table.column_names]
        if missing:
            raise ValueError(f"output has no column {missing[0]!r} (columns: {', '.join(table.column_names)})")
        rows = table.select([c for c in dict.fromkeys(wanted) if c in table.column_names]).to_pylist()
        by_id: dict[str, list[dict]] = {}
        for row in rows:
            by_id.setdefault(row["id"], []).append(row)
        for samples in by_id.values():
            samples.sort(key=lambda r: r.get(SAMPLE_INDEX) or 0)
            targets = [self.tallies]
            if self.group_column is not None:
                key = group_key(samples[0].get(self.group_column))
                if key not in self.group_inputs:
                    self.group_inputs[key], self.group_tallies[key] = 0, self._new()
                self.group_inputs[key] += 1
                targets.append(self.group_tallies[key])
            self.inputs += 1
            for m in self.metrics:
                passes, vote = self._row(samples, m)
                for tallies in targets:
                    for k in self.ks:
                        tallies[m].passes[k].add(passes[k] if passes else None)
                    tallies[m].majority.add(int(vote is not None), vote or 0.0, int(vote is None))

    def _row(self, samples: list[dict], metric: str) -> tuple[dict[int, Fraction] | None, float | None]:
        """One input row's pass@k per k and maj@n score for `metric` (None, None: unscored)."""
        scores = [s.get(score_column(metric)) for s in samples]
        if all(v is None for v in scores):
            return None, None
        n, correct = len(samples), sum(1 for v in scores if v == 1.0)
        if n < max(self.ks):
            raise ValueError(f"id {samples[0]['id']!r} has {n} sample rows, fewer than k={max(self.ks)}")
        passes = {k: pass_at_k(n, correct, k) for k in self.ks}
        winner = majority([self._answer(s, metric) for s in samples])
        if winner is None:
            return passes, 0.0
        # the winner is already the extracted answer, so regex_match compares it as exact_match does
        rule = "exact_match" if metric == "regex_match" else metric
        return passes, score_row(winner, samples[0].get(self.reference_column), rule, normalize_opts=self.normalize)

    def _answer(self, sample: dict, metric: str) -> str | None:
        """The sample's vote: its normalised answer, or None (failed, no match, no label). Failed
        is as everywhere else (`is_failed`): an error, or a structured output cut by max_tokens."""
        if is_failed(sample.get("finish_reason"), sample.get("error")):
            return None
        text = sample.get("label") if metric == "accuracy" else sample.get("generated_text")
        if metric == "regex_match" and text is not None:
            text = extract_answer(text, self.answer_regex)
        if text is None or (metric == "accuracy" and not text):
            return None
        return self.normalize(str(text))

    def merge(self, other: SampleMetrics) -> None:
        """Adds the counts of another accumulator of the same settings (disjoint tables)."""
        self.inputs += other.inputs
        for m, t in other.tallies.items():
            self.tallies[m].merge(t)
        for key, count in other.group_inputs.items():
            if key not in self.group_inputs:
                self.group_inputs[key], self.group_tallies[key] = 0, self._new()
            self.group_inputs[key] += count
            for m, t in other.group_tallies[key].items():
                self.group_tallies[key][m].merge(t)

    def results(self, tallies: dict[str, _Tallies]) -> dict[str, dict]:
        """{metric: {"pass@k": ..., "maj@n": ...}} of one set of tallies."""
        return {m: {**{f"pass@{k}": t.passes[k].result() for k in self.ks}, f"maj@{self.n}": t.majority.result()}
                for m, t in tallies.items()}

    def result(self) -> dict:
        """The totals and, per group key, the input rows and each metric's pass@k and maj@n."""
        return {"inputs": self.inputs, "metrics": self.results(self.tallies),
                "groups": {key: {"inputs": self.group_inputs[key], "metrics": self.results(self.group_tallies[key])}
                           for key in self.group_inputs}}
