"""What a job is: the spec's schema (a stage's spec, and the job's around it), the `Stage` its tasks run,
the `Job` handed around a run, the `Row` record, its output columns and metric names. Imports the engine's torch-free face (engine.api: config, sampling parameters, structured
outputs) only: never the engine itself, torch or Ray."""
from pipeline.errors import SpecError
from pipeline.spec.columns import (BASE_COLUMNS, FIELDS_COLUMNS, INCOMPLETE, LABEL_COLUMNS, METRICS, PROMPT_LOGPROBS,
                                   SAMPLE_INDEX, SCORE_PREFIX, check_metric_names, check_metrics, is_failed, output_columns,
                                   score_column)
from pipeline.spec.fingerprint import ADDED_FIELDS, TUNED_FIELDS
from pipeline.spec.resume import resumes
from pipeline.spec.row import Row
from pipeline.spec.row_sampling import SAMPLING_PARAMS, row_sampling
from pipeline.spec.job import Job
from pipeline.spec.lora import ADAPTER, LoRASpec
from pipeline.spec.pooling import POOLING_TASKS, EmbedSpec, ScoreSpec, reports_metrics
from pipeline.spec.structured import SCHEMA_FILE_FIELDS, StructuredOutputsSpec, schema_file_refs
from pipeline.spec.schema import (EvalSpec, InputSpec, JobSpec, LabelSpec, OutputSpec, ProcessorSpec, StageSpec,
                                  WorkersSpec, field_reference, validate)
from pipeline.spec.stage import Stage

__all__ = ["Row", "Stage", "StageSpec", "ProcessorSpec", "ADDED_FIELDS", "TUNED_FIELDS", "resumes", "SAMPLING_PARAMS", "row_sampling", "BASE_COLUMNS", "FIELDS_COLUMNS", "INCOMPLETE", "LABEL_COLUMNS", "METRICS", "PROMPT_LOGPROBS", "SAMPLE_INDEX",
           "SCHEMA_FILE_FIELDS", "SCORE_PREFIX", "EvalSpec", "InputSpec", "Job", "JobSpec", "LabelSpec", "OutputSpec",
           "SpecError", "StructuredOutputsSpec", "WorkersSpec", "check_metric_names", "check_metrics",
           "field_reference", "is_failed", "output_columns", "schema_file_refs", "score_column", "validate",
           "POOLING_TASKS", "EmbedSpec", "ScoreSpec", "reports_metrics", "ADAPTER", "LoRASpec"]
