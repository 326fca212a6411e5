"""The output table of a batch of rows: id (and sample_index when sampling.n > 1), the passed-through
input columns, then the task's."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pyarrow as pa

from pipeline.spec import SAMPLE_INDEX, SCORE_PREFIX, Stage, output_columns
from pipeline.tasks.label_fields import fields_type

if TYPE_CHECKING:
    from pipeline.spec import JobSpec, Row
    from pipeline.tasks.row_result import RowResult

_SCORES = pa.list_(pa.float64())
COLUMN_TYPES = {"generated_text": pa.string(), "num_prompt_tokens": pa.int64(), "num_generated_tokens": pa.int64(),
                "finish_reason": pa.string(), "error": pa.string(), SAMPLE_INDEX: pa.int64(), "label": pa.string(),
                "label_probs": _SCORES, "label_logprobs": _SCORES, "label_logprobs_per_token": _SCORES,
                "class_label": pa.string(), "class_probs": pa.list_(pa.float32()), "score": pa.float64(),
                "prompt_logprobs": _SCORES}
"""Arrow types of the columns the task writes (score_<metric> columns are float64), so that
every part of a job has the same schema, whatever its rows held."""


def column_type(name: str, spec: JobSpec | None = None, width: int | None = None) -> pa.DataType | None:
    """The Arrow type of output column `name`; label_fields' comes from the spec's label.json_schema,
    embedding's width from the engine (or embed.dimensions)."""
    if name.startswith(SCORE_PREFIX):
        return pa.float64()
    if name == "embedding":
        return pa.list_(pa.float32(), width) if width else pa.list_(pa.float32())
    if name == "label_fields" and spec is not None and isinstance(spec.label.json_schema, dict):
        return fields_type(spec.label.json_schema)
    return COLUMN_TYPES.get(name)


def output_table(stage: Stage | JobSpec, rows: list[Row], results: list[RowResult], width: int | None = None) -> pa.Table:
    """The output rows of a stage (or a job's spec): id, the passed-through input columns, then the
    task's columns (`width`: the embedding's, so every part of an embed job has one fixed-size list type)."""
    stage = Stage.of(stage)
    spec = stage.spec
    keep = stage.columns
    if keep is not None:  # eval needs its reference and group columns in the committed parts
        keep = set(keep) | {spec.eval.reference_column, spec.eval.group_column}
    produced = output_columns(spec)
    # images stay in the input unless input.columns names them
    hidden = {stage.image_column} if keep is None and stage.image_column else set()
    n = spec.sampling.n
    out = []
    for row, result in zip(rows, results):
        row_id = row.id
        passed = {name: value for name, value in row.values.items()
                  if (keep is None or name in keep) and name not in produced and name != "id" and name not in hidden}
        # n > 1: one row per sample, the input row's id and columns on each, its index after the id
        for sample in result.sample_results(n) if n > 1 else [result]:
            record = {"id": row_id, **({SAMPLE_INDEX: sample.sample_index} if n > 1 else {}), **passed}
            record.update((k, sample.column(k)) for k in produced)
            out.append(record)
    if not out:
        return pa.table({"id": pa.array([], pa.string()),
                         **{name: pa.array([], column_type(name, spec, width)) for name in produced}})
    names = list(dict.fromkeys(name for record in out for name in record))
    return pa.table({name: _column([record.get(name) for record in out], column_type(name, spec, width))
                     for name in names})


def _column(values: list, dtype: pa.DataType | None = None) -> pa.Array:
    """An Arrow column from Python values: of `dtype` for the columns this job writes; for passed-
    through input columns, mixed types become JSON text and a column that is null in every row
    becomes text, so that the parts of one job agree."""
    if dtype is not None:
        return pa.array(values, dtype)
    try:
        array = pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        array = pa.array([v if v is None or isinstance(v, str) else json.dumps(v, default=str) for v in values],
                         pa.string())
    return array.cast(pa.string()) if pa.types.is_null(array.type) else array
