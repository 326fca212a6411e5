"""What a job writes, by name: the output columns of each task and the eval metric names.

Names only (no Arrow types, no engine), so that validating a spec needs neither; the Arrow types
of these columns live with the code that builds the tables (pipeline.tasks.table).
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.api import VIOLATION
from pipeline.spec.lora import ADAPTER

if TYPE_CHECKING:
    from pipeline.spec.schema import JobSpec

BASE_COLUMNS = ("generated_text", "num_prompt_tokens", "num_generated_tokens", "finish_reason", "error")
"""Columns of every output row, whatever the task."""

LABEL_COLUMNS = ("label", "label_probs", "label_logprobs", "label_logprobs_per_token")
"""Columns of a label (or eval) task that picks its label by scoring choices."""

FIELDS_COLUMNS = ("label", "label_fields")
"""Columns of a label (or eval) task with label.json_schema: the object as JSON text, and a struct of
its top-level properties."""

POOLING_COLUMNS = {"embed": ["embedding"], "classify": ["class_label", "class_probs"], "score": ["score"]}
"""Columns of the pooling tasks: a fixed-size list<float32> embedding, a label and its probabilities,
a float64 score."""

INCOMPLETE = VIOLATION + "incomplete: max_tokens reached"
"""The error of a constrained row cut by max_tokens before its structure closed (its finish_reason
stays "length"): it counts as a failed row."""


def is_failed(finish_reason: str | None, error: str | None) -> bool:
    """Whether an output row counts against max_error_rate: it failed, or its structured output is
    incomplete or breaks its constraint (engine's VIOLATION; a note such as an unmatched
    label_regex does not count)."""
    return finish_reason == "error" or (error or "").startswith(VIOLATION)

METRICS = ("exact_match", "contains", "regex_match", "accuracy")
"""Metric names a spec may list under eval.metrics."""

SAMPLE_INDEX = "sample_index"
"""With sampling.n > 1, each input row gives n output rows, told apart by this column (0 .. n-1)."""

PROMPT_LOGPROBS = "prompt_logprobs"
"""With sampling.prompt_logprobs set (generating tasks): list<float64>, each prompt token's logprob
given the tokens before it, the first null (the OpenAI Batch output carries the top alternatives)."""

SCORE_PREFIX = "score_"
"""Per-row score columns are named SCORE_PREFIX + metric, e.g. score_exact_match."""


def score_column(metric: str) -> str:
    """Name of the per-row score column of `metric`."""
    return SCORE_PREFIX + metric


def output_columns(spec: JobSpec) -> list[str]:
    """Columns the job adds for `spec`'s task (an input column of the same name is replaced)."""
    names = ([SAMPLE_INDEX] if spec.sampling.n > 1 else []) + list(BASE_COLUMNS)
    label = spec.label
    if spec.task in ("label", "eval"):
        if label.choices or label.choices_column:
            names += LABEL_COLUMNS
        elif label.json_schema is not None:
            names += FIELDS_COLUMNS
        elif label.label_regex:
            names.append("label")
    names += POOLING_COLUMNS.get(spec.task, [])
    if spec.sampling.prompt_logprobs is not None and spec.task not in POOLING_COLUMNS and not (
            spec.task in ("label", "eval") and (label.choices or label.choices_column)):
        names.append(PROMPT_LOGPROBS)
    if spec.task == "eval" or (spec.task == "classify" and spec.eval.reference_column):
        names += [score_column(m) for m in spec.eval.metrics]
    if spec.lora.active:
        names.insert(names.index("generated_text"), ADAPTER)
    return names


def check_metrics(metrics: Sequence[str], answer_regex: str | re.Pattern | None = None) -> None:
    """Raises ValueError when the metric list or the regex cannot work (a spec error, fatal)."""
    check_metric_names(metrics)
    if "regex_match" in metrics:
        if answer_regex is None:
            raise ValueError("metric regex_match needs an answer_regex")
        if isinstance(answer_regex, re.Pattern):
            return
        if not isinstance(answer_regex, str):
            raise ValueError(f"answer_regex must be a string, got {type(answer_regex).__name__}")
        try:
            re.compile(answer_regex)
        except re.error as exc:
            raise ValueError(f"invalid answer_regex {answer_regex!r}: {exc}") from None


def check_metric_names(metrics: Sequence[str]) -> None:
    """Raises ValueError unless `metrics` is a non-empty list of known, distinct metric names."""
    if isinstance(metrics, str) or not metrics:
        raise ValueError(f"eval.metrics must be a non-empty list of {', '.join(METRICS)}")
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ValueError(f"unknown metric(s): {', '.join(map(str, unknown))} (known: {', '.join(METRICS)})")
    if len(set(metrics)) != len(metrics):
        raise ValueError(f"eval.metrics lists a metric twice: {list(metrics)}")
