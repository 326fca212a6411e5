"""How a job runs: the driver (run_job: its steps top to bottom) over three packages, one question
each, imported one way (driver -> checks -> shards -> reporting):

    checks/     before the engines start: preflight, adapters, whether the output accepts the job
    shards/     running the shards: planning, the dataflow, the engine actors, resources, devices,
                the unique-id check, Ray, fault-injection points
    reporting/  what the job reports: progress, counts and costs, metrics.json, manifest.json

The only package of the pipeline that imports Ray (with pipeline.processor, on top of it)."""
from pipeline.errors import JobError, OutputConflict
from pipeline.run.checks.adapters import check_adapters, listed_adapters, with_adapters
from pipeline.run.checks.preflight import check_model, input_columns, preflight
from pipeline.run.driver import JobResult, run_job
from pipeline.run.reporting.progress import Progress, ProgressBar, as_progress
from pipeline.run.reporting.report import PartTotals, output_report
from pipeline.run.shards.planner import job_shards, output_plan
from pipeline.run.shards.ray_env import ensure_ray
from pipeline.run.shards.resources import actor_request, engine_stage_args
from pipeline.run.shards.worker import EngineActor, ShardWorker

__all__ = ["EngineActor", "JobError", "JobResult", "OutputConflict", "PartTotals", "Progress", "ProgressBar",
           "ShardWorker", "actor_request", "as_progress", "check_model", "engine_stage_args", "ensure_ray",
           "input_columns", "job_shards", "output_plan", "output_report", "preflight", "run_job", "check_adapters", "listed_adapters", "with_adapters"]
