"""The unique-id check of input.id_column, at any input size, with no process holding every id.

The input is planned as for the job (Ray tasks), each shard's ids are read by Ray tasks, and
Ray Data's group-by hash-partitions the ids over the cluster and counts each one; the driver
only receives the first id counted twice, if any. Cost: one extra read of the id column of the
whole input and a shuffle of the ids (about the ids' size over the network), once per job:
`_job.json` records a passed check, so resumes skip it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.errors import JobError
from pipeline.io import Shard, Storage, read_shard, with_retries
from pipeline.run.planner import ShardPlan, planned_dataset
from pipeline.run.ray_env import quiet_ray_data, worker_cause

if TYPE_CHECKING:
    from pipeline.spec import JobSpec


def check_unique_ids(spec: JobSpec, files: list, plan: ShardPlan) -> None:
    """Raises JobError naming the first duplicate id found (Ray must be initialised)."""
    from ray.data.expressions import col

    quiet_ray_data()
    column = spec.input.id_column
    ds = planned_dataset(spec, files, resume=False, plan=plan)
    ds = ds.map_batches(shard_ids, fn_kwargs={"spec": spec}, batch_size=1, batch_format="numpy")
    try:
        dup = ds.groupby("id").count().filter(expr=col("count()") > 1).take(1)
    except Exception as exc:  # an unreadable shard: the cause in one line
        raise JobError(worker_cause(exc)) from exc
    if dup:
        raise JobError(f"duplicate id {dup[0]['id']!r} in column {column!r} (ids must be unique)")


def shard_ids(batch: dict, spec: JobSpec) -> dict:
    """Ray Data stage: the id_column values of a batch of shards."""
    storage = Storage(spec.input.path, spec.input.storage_options)
    column = spec.input.id_column
    ids = []
    first = spec.lora.each_adapters[0] if spec.lora.each else ""
    for shard in Shard.from_batch(batch):
        if shard.lora_each and shard.adapter != first:
            continue  # lora.each plans each input shard once per adapter: its ids count once
        rows, _, _ = with_retries(lambda: read_shard(storage, shard), f"reading {shard.name}")
        ids += [str(r[column]) for r in rows if r.get(column) is not None]
    return {"id": ids}
