"""The spec's cross-field rules, each in one message naming the keys involved: what a row goes through
(check_stage, for every spec), and the job around it (check_job) or a processor's (check_processor)."""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

from pipeline.spec.columns import check_metrics, output_columns
from pipeline.spec.images import check_images
from pipeline.spec.lora import check_lora
from pipeline.spec.pooling import check_pooling
from pipeline.spec.structured import check_label_schema

if TYPE_CHECKING:
    from pipeline.spec.schema import JobSpec, ProcessorSpec, StageSpec


def check_job(spec: JobSpec) -> None:
    """The job's rules around its stage: LoRA by input format, OpenAI Batch input and output, images,
    GPUs per actor."""
    inp = spec.input
    check_lora(spec, requests=inp.format == "openai_batch")
    if inp.format == "openai_batch":
        if spec.task != "generate":
            raise ValueError(f"input.format openai_batch holds completion requests: task {spec.task} needs jsonl or "
                             "parquet input")
        if inp.template or inp.messages_column or inp.system_prompt or inp.few_shot:
            raise ValueError("input.format openai_batch: the requests carry their own prompts; drop input.template, "
                             "messages_column, system_prompt and few_shot")
        if inp.id_column not in (None, "custom_id"):
            raise ValueError("input.format openai_batch: rows are identified by custom_id; drop input.id_column")
        inp.id_column = "custom_id"  # a duplicate custom_id is then fatal, like any duplicate id
    if spec.output.format == "openai_batch" and spec.task != "generate":
        raise ValueError(f"output.format openai_batch holds completions only: task {spec.task} needs parquet or jsonl")
    check_images(spec)
    check_gpus(spec)


def check_processor(spec: ProcessorSpec) -> None:
    """A processor's rules around its stage: its rows are the Dataset's, never OpenAI Batch lines."""
    check_lora(spec, requests=False)
    check_gpus(spec)


def check_gpus(spec: JobSpec | ProcessorSpec) -> None:
    """With engine.tensor_parallel_size N on GPU an actor holds one GPU per rank: workers.gpus is N,
    and becomes N when left unset with engine.device cuda."""
    n, workers = spec.engine.tensor_parallel_size, spec.workers
    if "gpus" not in workers.model_fields_set and spec.engine.device.startswith("cuda"):
        workers.gpus = float(n)
    if n > 1 and workers.gpus and workers.gpus != n:
        raise ValueError(f"workers.gpus {workers.gpus:g} with engine.tensor_parallel_size {n}: an actor needs one GPU "
                         f"per rank; set workers.gpus: {n} (or 0 to run the ranks on CPU), or leave it unset with "
                         "engine.device: cuda")


def check_stage(spec: StageSpec) -> None:
    """Cross-field rules of what a row goes through: the task and its sections (one message naming the
    keys involved). Input and output formats are the job's (check_job)."""
    label, ev = spec.label, spec.eval
    labels = bool(label.choices or label.choices_column or label.label_regex or label.json_schema is not None)
    check_structured(spec)
    check_pooling(spec)
    for name in ("logprobs", "prompt_logprobs"):
        asked = getattr(spec.sampling, name)
        if asked is not None and asked > spec.engine.max_logprobs:
            raise ValueError(f"sampling.{name} ({asked}) is above engine.max_logprobs "
                             f"({spec.engine.max_logprobs}): raise engine.max_logprobs, or ask for fewer")
    if label.choices is not None and (not label.choices or any(not c for c in label.choices)):
        raise ValueError("label.choices: give at least one non-empty choice")
    if label.choices and label.choices_column:
        raise ValueError("label.choices and label.choices_column: set one of them")
    if (label.choices or label.choices_column) and label.label_regex:
        raise ValueError("label.label_regex applies to generated labels: drop it, or drop label.choices(_column)")
    for name, pattern in (("label.label_regex", label.label_regex), ("eval.answer_regex", ev.answer_regex)):
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"{name}: invalid regex: {exc}") from None
    check_samples(spec)
    if spec.task == "label" and not labels:
        raise ValueError("task label needs label.choices, label.choices_column, label.label_regex or "
                         "label.json_schema")
    if spec.task == "eval":
        if not ev.reference_column:
            raise ValueError("task eval needs eval.reference_column")
        try:
            check_metrics(ev.metrics, ev.answer_regex)
        except ValueError as exc:
            raise ValueError(f"eval.metrics: {exc}") from None
        if "accuracy" in ev.metrics and not labels and spec.task == "eval":
            raise ValueError("eval metric accuracy compares labels: set label.choices, label.choices_column or "
                             "label.label_regex")
    produced = set(output_columns(spec)) | {"id"}
    for name, column in (("eval.reference_column", ev.reference_column), ("eval.group_column", ev.group_column),
                         ("label.choices_column", label.choices_column)):
        if column in produced and (spec.task == "eval" or name.startswith("label")):
            raise ValueError(f"{name}: {column!r} is also an output column of task {spec.task}; rename it in the "
                             "input data")


def check_samples(spec: StageSpec) -> None:
    """sampling.n's rules: choice scoring draws no samples, and each eval.k is a number of samples."""
    n, label = spec.sampling.n, spec.label
    if n > 1 and spec.task in ("label", "eval") and (label.choices or label.choices_column):
        raise ValueError("sampling.n: choice scoring (label.choices, label.choices_column) picks one label per row "
                         "without sampling; drop sampling.n, or generate labels with label.label_regex")
    ks = spec.eval.k
    if ks is not None:
        if not ks:
            raise ValueError("eval.k: give at least one k, or leave it unset for [1, n]")
        bad = [k for k in ks if isinstance(k, bool) or not 1 <= k <= n]
        if bad:
            raise ValueError(f"eval.k: each k must be in [1, sampling.n={n}], got {bad[0]}")
        if len(set(ks)) != len(ks):
            raise ValueError(f"eval.k lists a k twice: {ks}")


def check_structured(spec: StageSpec) -> None:
    """label.json_schema is a label of its own kind, and the only constraint of its rows."""
    label = spec.label
    if label.json_schema is None:
        return
    check_label_schema(label.json_schema)
    if label.choices or label.choices_column or label.label_regex:
        raise ValueError("label.json_schema generates the label: drop label.choices, choices_column and label_regex")
    if spec.sampling.structured_outputs is not None:
        raise ValueError("label.json_schema constrains the generated label: drop sampling.structured_outputs")


