"""The Ray Data pipeline of a job: plan (Ray tasks) -> read + generate + commit (engine actors).

The driver consumes one commit record per shard as the stream delivers them, adds each to the
part index and to the job's totals, and prints progress; it never holds the plan.
"""
from __future__ import annotations

import gc
import logging
import threading
from typing import TYPE_CHECKING

from pipeline.errors import JobError
from pipeline.io import CommitRecord, IndexWriter, RunRecord
from pipeline.run.shards import chaos
from pipeline.run.shards.planner import ShardPlan, plan_blocks, planned_dataset
from pipeline.run.shards.ray_env import quiet_ray_data, worker_cause
from pipeline.run.reporting.report import PartTotals
from pipeline.run.shards.resources import engine_stage_args
from pipeline.run.shards.worker import ShardWorker

if TYPE_CHECKING:
    from pipeline.spec import Job

log = logging.getLogger(__name__)

EXECUTOR_JOIN_S = 10.0  # a failed execution's loop ends within seconds of its shutdown


class StopSignal:
    """A job-wide stop the driver raises and the engine actors ask for before each shard: one
    small Ray actor that needs no CPU, made for a job that may be stopped (the unique-id check)."""

    def __init__(self):
        self.reason: str | None = None

    def set(self, reason: str) -> None:
        self.reason = self.reason or reason

    def get(self) -> str | None:
        return self.reason


def execute(job: Job, files: list, resume: bool, plan: ShardPlan, run: RunRecord, index: IndexWriter,
            progress, stop=None, lock=None) -> PartTotals:
    """Runs every shard of `files` through the actor pool. Each shard's commit record goes to
    `index` and to the returned totals; the counts of shards committed now are added to `run`.
    `stop`: what may stop the job while it runs (a pipeline.run.shards.unique_ids.IdCheck): its failure
    ends the run, the engine actors starting no shard after it. `lock`: the run's RunLock; once it is
    lost the run ends, and each engine actor checks the lock's record before it commits a shard."""
    import ray

    quiet_ray_data()
    signal = None
    if stop is not None:
        signal = ray.remote(num_cpus=0)(StopSignal).remote()
        stop.on_failure(lambda exc: signal.set.remote(str(exc)))
    # Each planning task hands its shards on as one block, and a block goes to one actor: an actor
    # beyond the number of planning tasks would load its model and never get a shard.
    run.workers = min(job.spec.workers.num, plan_blocks(files, plan.segment_bytes))
    ds = planned_dataset(job.spec, files, resume, plan).map_batches(
        ShardWorker, fn_constructor_kwargs={"job": job, "stop": signal, "lock_owner": getattr(lock, "owner", None)},
        batch_size=1, batch_format="numpy",
        **engine_stage_args(job.spec.workers, actors=run.workers, env=chaos.forwarded_env()))
    totals, earlier = PartTotals(), 0
    progress.start(None, None, getattr(files, "total_bytes", None))  # the plan streams in: bytes, not rows
    rows, failure = iter(ds.iter_rows()), None
    try:
        for row in rows:
            record: CommitRecord = row["record"]
            index.add(record)
            totals.add(record)
            if row["new"]:
                run.add(record)
            else:
                earlier += 1
            progress.shard_done(run, record.rows if row["new"] else 0, earlier, nbytes=record.bytes,
                                new=bool(row["new"]))
            if stop is not None and stop.failure() is not None:
                raise stop.failure()
            if lock is not None:
                lock.check()
    except Exception as exc:  # Ray wraps worker exceptions; surface the cause in one line
        failure = exc
    finally:
        getattr(rows, "close", lambda: None)()
        progress.close()
    if failure is not None:
        message = worker_cause(failure)
        try:
            _release(failure)
            del ds, rows
            gc.collect()
        except Exception:  # the job's own error is what its caller must see
            log.debug("releasing a failed execution", exc_info=True)
        raise JobError(message) from failure
    index.flush()
    return totals


def _release(failure: BaseException) -> None:
    """After a failed stream: let Ray Data's executor thread finish shutting down, then clear the
    frames the failure's chain of exceptions holds, and the finished frames that called them: Ray
    Data's, holding its executor and through it the engine actors' handles. Collected, the actors
    go now, not whenever the caller (Airflow, a test, a retry loop) lets the exception go."""
    for thread in threading.enumerate():
        if thread.name.startswith("StreamingExecutor-") and getattr(thread, "_shutdown", False):
            thread.join(timeout=EXECUTOR_JOIN_S)
    seen: set[int] = set()
    chain: list = [failure]
    while chain:
        exc = chain.pop()
        if not isinstance(exc, BaseException) or id(exc) in seen:
            continue
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            while frame is not None:
                try:
                    frame.clear()
                except Exception:  # still running (this thread's callers), or a generator's close failed
                    pass
                frame = frame.f_back
            tb = tb.tb_next
        chain += [exc.__cause__, exc.__context__, getattr(exc, "cause", None)]
