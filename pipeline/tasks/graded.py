"""task eval (and classify with eval.reference_column): the rows of another task, each graded against
its reference (pipeline.tasks.grading: the `score_<metric>` columns); pipeline.run.reporting.metrics
aggregates the committed grades into metrics.json."""
from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.tasks import grading
from pipeline.tasks.task import Task

if TYPE_CHECKING:
    from pipeline.spec import JobSpec, Row
    from pipeline.tasks.row_result import RowResult
    from pipeline.tasks.task import Request


class Graded(Task):
    """Runs `inner` (generate, a label task, classify), then grades every sample row on its own (a row
    that drew no samples is graded once: its copies share it)."""

    def __init__(self, spec: JobSpec, inner: Task):
        super().__init__(inner.engine, inner.lora)
        self.inner = inner
        self.eval = spec.eval

    def run(self, rows: list[Row], loras=None) -> list[RowResult]:
        return self.finish(rows, self.inner.run(rows, loras))

    def prepare(self, index: int, row: Row) -> Request:
        return self.inner.prepare(index, row)

    def call(self, requests: list[Request]) -> list:
        return self.inner.call(requests)

    def collect(self, row: Row, request: Request, output) -> RowResult:
        return self.inner.collect(row, request, output)

    def finish(self, rows: list[Row], results: list[RowResult]) -> list[RowResult]:
        ev = self.eval
        normalize = ev.normalize.model_dump()
        pairs = [(row, sample) for row, result in zip(rows, results) for sample in result.sample_results()]
        samples = [sample for _, sample in pairs]
        refs = [row.get(ev.reference_column) for row, _ in pairs]
        failed = [r.failed for r in samples]
        columns = {}
        text_metrics = [m for m in ev.metrics if m != "accuracy"]
        if text_metrics:
            preds = [None if bad else r.generated_text for r, bad in zip(samples, failed)]
            columns.update(grading.score_columns(preds, refs, text_metrics, normalize_opts=normalize,
                                                 answer_regex=ev.answer_regex))
        if "accuracy" in ev.metrics:
            # a generated label that did not parse counts as wrong, not as missing
            preds = [None if bad else (r.label or "") for r, bad in zip(samples, failed)]
            columns.update(grading.score_columns(preds, refs, ["accuracy"], normalize_opts=normalize))
        for name, values in columns.items():
            for sample, value in zip(samples, values):
                sample.scores[name] = value
        return results
