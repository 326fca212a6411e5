"""One class per task over one base run: the base prepares each row (a row's own problem is its error
alone, a row that failed reading keeps its error, no row is changed), makes one engine call for the
rows that run, and collects each answer in row order; TaskRunner picks each spec's class."""
from __future__ import annotations

import pytest

from engine.api import EngineFacts
from pipeline.spec import Row, validate
from pipeline.tasks import Request, RowError, RowResult, Task, task_for
from pipeline.tasks.choices import LabelByChoices
from pipeline.tasks.generate import Generate, LabelByFields, LabelByParsing
from pipeline.tasks.graded import Graded
from pipeline.tasks.openai_batch.lines import OpenAIBatchLines
from pipeline.tasks.pooling import Classify, Embed, Score


class Doubling(Task):
    """A task of its own: a row's `n` doubled, one call for every row that runs."""

    def __init__(self):
        super().__init__(engine=None)
        self.calls = []

    def prepare(self, index, row):
        if not isinstance(row.get("n"), int):
            raise RowError(f"n must be an integer, got {row.get('n')!r}")
        return Request(index, row.get("n"))

    def call(self, requests):
        self.calls.append([r.index for r in requests])
        return [2 * r.prompt for r in requests]

    def collect(self, row, request, output):
        return RowResult(str(output), finish_reason="stop")


def test_the_base_run_handles_every_rows_error_once_and_calls_once():
    rows = [Row("a", {"n": 1}), Row("b", {}, "in.jsonl line 2: malformed JSON"), Row("c", {"n": "x"}),
            Row("d", {"n": 4})]
    task = Doubling()
    results = task.run(rows)
    assert [r.generated_text for r in results] == ["2", "", "", "8"]
    assert [r.error for r in results] == [None, "in.jsonl line 2: malformed JSON", "n must be an integer, got 'x'",
                                          None]
    assert [r.finish_reason for r in results] == ["stop", "error", "error", "stop"]
    assert task.calls == [[0, 3]]  # one call, the rows that run, in order
    assert rows[2] == Row("c", {"n": "x"})  # rows are never changed
    assert Doubling().run([Row("x", {}, "bad")]) == [RowResult(error="bad")]  # no call without a row to run


class _Facts:
    def facts(self):
        return EngineFacts(model="m", kind="echo", max_model_len=64)


BASE = {"model": "builtin:tiny", "input": {"path": "in.jsonl"}, "output": {"path": "out"}}


@pytest.mark.parametrize("sections, kind", [
    ({}, Generate),
    ({"task": "label", "label": {"choices": ["a", "b"]}}, LabelByChoices),
    ({"task": "label", "label": {"label_regex": "(yes|no)"}}, LabelByParsing),
    ({"task": "label", "label": {"json_schema": {"type": "object", "properties": {"x": {"type": "string"}}}}},
     LabelByFields),
    ({"task": "eval", "eval": {"reference_column": "ref"}}, (Graded, Generate)),
    ({"task": "eval", "eval": {"reference_column": "ref", "metrics": ["accuracy"]}, "label": {"choices": ["a"]}},
     (Graded, LabelByChoices)),
    ({"task": "embed"}, Embed),
    ({"task": "classify"}, Classify),
    ({"task": "classify", "eval": {"reference_column": "ref", "metrics": ["accuracy"]}}, (Graded, Classify)),
    ({"task": "score"}, Score),
    ({"input": {"path": "in.jsonl", "format": "openai_batch"}}, OpenAIBatchLines),
])
def test_each_spec_gets_its_tasks_class(sections, kind):
    spec = validate({**BASE, **sections})
    task = task_for(spec.stage(), _Facts(), prompts=None, lora=False)
    if isinstance(kind, tuple):
        assert type(task) is kind[0] and type(task.inner) is kind[1]
    else:
        assert type(task) is kind
