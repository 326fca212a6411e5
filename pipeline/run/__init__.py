"""How a job runs: the driver, planning, the dataflow, the engine actors, checks before they start,
resources, the unique-id check, progress, the final files and manifest, and reports. The only
package of the pipeline that imports Ray (with pipeline.processor, on top of it)."""
from pipeline.errors import JobError, OutputConflict
from pipeline.run.adapters import check_adapters, with_adapters
from pipeline.run.driver import JobResult, run_job
from pipeline.run.preflight import check_model, input_columns, preflight
from pipeline.run.progress import Progress, ProgressBar, as_progress
from pipeline.run.ray_env import ensure_ray
from pipeline.run.report import PartTotals, output_report
from pipeline.run.resources import actor_request, engine_stage_args
from pipeline.run.worker import EngineActor, ShardWorker

__all__ = ["EngineActor", "JobError", "JobResult", "OutputConflict", "PartTotals", "Progress", "ProgressBar",
           "ShardWorker", "actor_request", "as_progress", "check_model", "engine_stage_args", "ensure_ray",
           "input_columns", "output_report", "preflight", "run_job", "check_adapters", "with_adapters"]
