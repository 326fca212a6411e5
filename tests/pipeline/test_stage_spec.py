"""A stage's spec (what a row goes through) apart from the job around it: a job's spec is a stage's
with input, output, workers and report; build_processor takes a stage with its workers, and builds
no job with placeholder paths; the YAML a user writes and every fingerprint stay as they were."""
from __future__ import annotations

import pytest

from pipeline.processor import build_processor
from pipeline.spec import JobSpec, ProcessorSpec, SpecError, Stage, StageSpec, validate

SECTIONS = {"model": "builtin:tiny", "task": "label", "label": {"choices": ["yes", "no"]},
            "sampling": {"max_tokens": 3}, "seed": 7}


def test_a_job_is_its_stage_and_the_job_around_it():
    job = validate({**SECTIONS, "input": {"path": "in.jsonl", "template": "Q: {q}", "sampling_column": "p"},
                    "output": {"path": "out", "format": "jsonl"}})
    assert isinstance(job, StageSpec)
    assert set(StageSpec.model_fields) == {"model", "task", "engine", "sampling", "label", "eval", "embed", "score",
                                           "lora", "seed"}
    assert set(JobSpec.model_fields) - set(StageSpec.model_fields) == {"input", "output", "workers", "report",
                                                                       "max_error_rate"}
    stage = job.stage()
    assert stage.spec is job and stage.prompts.template == "Q: {q}" and stage.sampling_column == "p"
    assert (stage.requests, stage.lines) == (False, False)
    lines = validate({"model": "builtin:tiny", "input": {"path": "in.jsonl", "format": "openai_batch"},
                      "output": {"path": "out", "format": "openai_batch"}}).stage()
    assert (lines.requests, lines.lines) == (True, True) and Stage.of(lines) is lines


def test_build_processor_takes_a_stage_and_its_workers_and_no_paths():
    processor = build_processor({**SECTIONS, "workers": {"num": 2}})
    spec = processor.spec
    assert type(spec) is ProcessorSpec and not hasattr(spec, "input") and not hasattr(spec, "output")
    job = validate({**SECTIONS, "input": {"path": "x"}, "output": {"path": "y"}})
    stage_fields = set(StageSpec.model_fields)
    assert spec.model_dump(include=stage_fields) == job.model_dump(include=stage_fields)
    for key in ("input", "output", "report", "max_error_rate"):
        with pytest.raises(SpecError, match=f"{key}: not a processor setting"):
            build_processor({**SECTIONS, key: {}})


def test_a_processor_config_is_checked_by_the_stages_rules():
    with pytest.raises(SpecError, match="label.choices and label.choices_column: set one of them"):
        build_processor({**SECTIONS, "label": {"choices": ["a"], "choices_column": "c"}})
    with pytest.raises(SpecError, match="invalid processor config: sampling.max_tokenz"):
        build_processor({**SECTIONS, "sampling": {"max_tokenz": 3}})
