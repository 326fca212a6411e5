"""The Ray Data pipeline of a job: plan (Ray tasks) -> read + generate + commit (engine actors).

The driver consumes one commit record per shard as the stream delivers them, adds each to the
part index and to the job's totals, and prints progress; it never holds the plan.
"""
from __future__ import annotations

import json
import logging
import os
import re
from typing import TYPE_CHECKING

from engine.errors import one_line
from pipeline import chaos
from pipeline.index import IndexWriter
from pipeline.planner import ShardPlan, planned_dataset
from pipeline.report import PartTotals
from pipeline.sink import SUMMARY_FIELDS
from pipeline.source import InputError
from pipeline.worker import FatalShardError, ShardWorker

if TYPE_CHECKING:
    from pipeline.job import Job

FATAL_ERRORS = (FatalShardError, InputError)
"""Exceptions raised in a Ray task or actor whose message is the job's one-line cause."""


class JobError(RuntimeError):
    """A fatal problem: the job cannot run. The message is the one-line cause."""


def ensure_ray(address: str | None) -> None:
    import ray

    if ray.is_initialized():
        return
    quiet = dict(logging_level=logging.WARNING, log_to_driver=True)
    if address or os.environ.get("RAY_ADDRESS"):  # `ray job submit` sets RAY_ADDRESS for the driver
        ray.init(address=address, **quiet)
    else:
        ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, **quiet)  # a fresh local Ray, sized to this machine


def quiet_ray_data() -> None:
    """Ray Data's own progress bars and per-dataset logs off: the job reports its own progress
    (pipeline.progress), and two bars never draw at once."""
    import ray

    logging.getLogger("ray.data").setLevel(logging.WARNING)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    ctx.enable_auto_log_stats = False
    detectors = getattr(ctx, "issue_detectors_config", None)
    if detectors is not None:  # per-actor memory advice is noise for a model-sized actor
        detectors.high_memory_detector_config.detection_time_interval_s = -1


def execute(job: Job, files: list, resume: bool, plan: ShardPlan, run: dict, index: IndexWriter,
            progress) -> PartTotals:
    """Runs every shard of `files` through the actor pool. Each shard's commit record goes to
    `index` and to the returned totals; the counts of shards committed now are added to `run`."""
    import ray

    quiet_ray_data()
    workers = job.spec.workers
    chaos_env = chaos.forwarded_env()
    ds = planned_dataset(job.spec, files, resume, plan).map_batches(
        ShardWorker, fn_constructor_kwargs={"job": job}, batch_size=1, batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=workers.num),
        num_cpus=workers.cpus, num_gpus=workers.gpus or None,
        runtime_env={"env_vars": chaos_env} if chaos_env else None,
    )
    totals, earlier = PartTotals(), 0
    progress.start(None, None, getattr(files, "total_bytes", None))  # the plan streams in: bytes, not rows
    rows = iter(ds.iter_rows())
    try:
        for row in rows:
            record = json.loads(row["record"])
            index.add(record)
            totals.add(record)
            if row["new"]:
                for k in SUMMARY_FIELDS:
                    run[k] += int(record.get(k, 0))
            else:
                earlier += 1
            progress.shard_done(run, int(record.get("rows", 0)) if row["new"] else 0, earlier,
                                nbytes=int(record.get("bytes", 0)), new=bool(row["new"]))
    except Exception as exc:  # Ray wraps worker exceptions; surface the cause in one line
        raise JobError(worker_cause(exc)) from exc
    finally:
        # Closing the stream shuts Ray Data's executor down now: after a failure, the engine
        # actors must not live on for as long as the caller keeps the exception (Airflow, tests).
        getattr(rows, "close", lambda: None)()
        progress.close()
    index.flush()
    return totals


def worker_cause(exc: BaseException) -> str:
    """The cause of a worker failure that Ray wrapped (RayTaskError, UserCodeException). Ray
    ships the remote exception as text inside the wrapper, so the cause is looked up there."""
    chain, seen = [], set()
    while isinstance(exc, BaseException) and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        exc = getattr(exc, "cause", None) or exc.__cause__
    for item in chain:
        if isinstance(item, FATAL_ERRORS):
            return str(item)
        for cls in FATAL_ERRORS:
            found = re.search(rf"{cls.__name__}: (.+)", str(item))
            if found:
                return found.group(1).strip()
    for item in chain:
        found = re.findall(r"^(\w+(?:Error|Exception): .+)$", str(item), flags=re.M)
        if found:
            return f"a worker failed: {found[-1].strip()}"
    return f"a worker failed: {one_line(chain[-1])}"
