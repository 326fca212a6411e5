"""What a job is: the spec's schema, the `Job` handed around a run, its output columns and metric
names. Imports engine.config and engine.sampling_params only: never the engine, torch or Ray."""
from pipeline.errors import SpecError
from pipeline.spec.columns import (BASE_COLUMNS, LABEL_COLUMNS, METRICS, SAMPLE_INDEX, SCORE_PREFIX,
                                   check_metric_names, check_metrics, output_columns, score_column)
from pipeline.spec.job import Job
from pipeline.spec.schema import (ADDED_FIELDS, EvalSpec, InputSpec, JobSpec, LabelSpec, OutputSpec, WorkersSpec,
                                  field_reference, validate)

__all__ = ["ADDED_FIELDS", "BASE_COLUMNS", "LABEL_COLUMNS", "METRICS", "SAMPLE_INDEX", "SCORE_PREFIX", "EvalSpec",
           "InputSpec", "Job", "JobSpec", "LabelSpec", "OutputSpec", "SpecError", "WorkersSpec", "check_metric_names",
           "check_metrics", "field_reference", "output_columns", "score_column", "validate"]
