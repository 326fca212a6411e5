"""Planning as Ray Data tasks: blocks of input files -> shards, streamed to the engine actors.

The driver only lists the input files. Each planning task takes a block of them, reads Parquet
footers and JSONL line ends (pipeline.source.plan_file), and emits that block's shards; the
actor pool starts on the first block's shards while later blocks are still being planned, so
no process ever holds the whole plan. On a resume a task also marks the shards whose part is
already committed (one existence check per shard, plus its commit record), and the actors pass
those through without work. Each task records what it planned under _plan/, so a partial
report can say how many shards the input has.
"""
from __future__ import annotations

import hashlib
import json
import time
from typing import TYPE_CHECKING

import pyarrow as pa

from pipeline.sink import PLAN_DIR, OutputDir
from pipeline.source import Shard, plan_file
from pipeline.storage import Storage, with_retries

if TYPE_CHECKING:
    from pipeline.spec import JobSpec

FILES_PER_PLAN_TASK = 8
"""Files one planning task takes at most (more once MAX_PLAN_BLOCKS is reached): fewer, longer
tasks cost less Ray overhead; the first shards wait for the first task only."""

BYTES_PER_PLAN_TASK = 256 << 20
"""Input bytes one planning task takes at most (a larger file alone), as far as the listing gives
sizes: a task hands its shards on only when it is done, so large files get a task each."""

MAX_PLAN_BLOCKS = 1000
"""Planning tasks per job at most."""

PLAN_TASK_MEMORY = 128 << 20
"""Memory reserved per planning task (it reads 8 MiB blocks and holds one block's shards)."""

LEGACY_ROWS_PER_SHARD = 256
"""Layout-1 outputs (before shard_bytes) were planned by rows only, 256 by default."""

SHARD_SCHEMA = pa.schema([("file", pa.string()), ("name", pa.string()), ("format", pa.string()),
                          ("start", pa.int64()), ("stop", pa.int64()), ("byte_start", pa.int64()),
                          ("byte_stop", pa.int64()), ("committed", pa.string())])
"""A planned shard as a Ray Data row; `committed` = its commit record (JSON) if already done, else ""."""


def plan_groups(files: list) -> list[list[int]]:
    """The input files (indices, in order) each planning task takes: consecutive files, at most
    FILES_PER_PLAN_TASK of them and BYTES_PER_PLAN_TASK bytes, both limits raised as needed to
    stay within MAX_PLAN_BLOCKS tasks. Sizes come from the listing (`InputFiles.sizes`)."""
    n = len(files)
    sizes = getattr(files, "sizes", None) or [None] * n
    per_task = max(FILES_PER_PLAN_TASK, -(-n // MAX_PLAN_BLOCKS))
    known = [b for b in sizes if b is not None]
    byte_cap = max(BYTES_PER_PLAN_TASK, -(-sum(known) // MAX_PLAN_BLOCKS) if known else 0)
    while True:
        groups, group, group_bytes = [], [], 0
        for i in range(n):
            size = sizes[i] or 0
            if group and (len(group) >= per_task or group_bytes + size > byte_cap):
                groups.append(group)
                group, group_bytes = [], 0
            group.append(i)
            group_bytes += size
        if group:
            groups.append(group)
        if len(groups) <= MAX_PLAN_BLOCKS:
            return groups or [[]]
        byte_cap *= 2  # greedy packing left too many tasks: looser byte limit


def plan_blocks(files: list) -> int:
    """How many planning tasks plan `files`."""
    return len(plan_groups(files))


def shard_limits(spec: JobSpec, layout: int) -> tuple[int | None, int | None]:
    """(rows, bytes) that end a shard. Layout 1 is planned as it was, so its shard keys match."""
    workers = spec.workers
    if layout == 1:
        return workers.rows_per_batch or LEGACY_ROWS_PER_SHARD, None
    return workers.rows_per_batch, workers.shard_bytes


def planned_dataset(spec: JobSpec, files: list[tuple[str, str, str]], resume: bool, layout: int):
    """A Ray Dataset of shard rows (SHARD_SCHEMA), planned by Ray tasks as it is consumed."""
    import ray

    # One item per planning task, holding its files, so that the tasks are what plan_groups says.
    groups = plan_groups(files)
    items = [{"path": [files[i][0] for i in g], "name": [files[i][1] for i in g], "format": [files[i][2] for i in g]}
             for g in groups]
    blocks = len(groups)
    ds = ray.data.from_items(items, override_num_blocks=blocks)
    # Planning tasks reserve no CPU: they are I/O-bound, and the engine actors may hold every
    # CPU of the cluster (planning would then never be scheduled and the job would hang); at most
    # one runs per CPU of the cluster, so they cannot start hundreds of worker processes. Their
    # memory request, which the actors do not make, keeps Ray Data from fusing planning into the
    # actors: it runs in its own tasks, ahead of the actors, not inside them between shards.
    return ds.map_batches(plan_block, fn_kwargs={"spec": spec, "resume": resume, "layout": layout},
                          batch_size=None, batch_format="pyarrow", num_cpus=0, memory=PLAN_TASK_MEMORY,
                          concurrency=max(1, min(blocks, int(ray.cluster_resources().get("CPU", 1)))))


def plan_block(batch: pa.Table, spec: JobSpec, resume: bool, layout: int) -> pa.Table:
    """Ray Data stage: the shards of a block of input files, committed ones marked."""
    storage = Storage(spec.input.path, spec.input.storage_options)
    out = OutputDir(Storage(spec.output.path, spec.output.storage_options), spec.output.format)
    rows, nbytes = shard_limits(spec, layout)
    started = time.perf_counter()
    def column(name: str) -> list:
        return [v for group in batch.column(name).to_pylist() for v in group]

    names = column("name")
    shards: list[Shard] = []
    for path, name, fmt in zip(column("path"), names, column("format")):
        shards += plan_file(storage, path, name, fmt, rows, nbytes, attempts=5)
    committed = [_committed(out, s) if resume else "" for s in shards]
    _record(out, names, shards, time.perf_counter() - started)
    columns = {f: [getattr(s, f) for s in shards] for f in SHARD_SCHEMA.names[:-1]}
    return pa.table({**columns, "committed": committed}, schema=SHARD_SCHEMA)


def shard_identity(out: OutputDir, shard: Shard) -> dict:
    """The fields of a commit record / index entry that say which shard and part it is."""
    return {"shard": shard.key, "path": out.storage.uri(out.part_path(shard.key)), "file": shard.name,
            "start": shard.start, "stop": shard.stop, "bytes": shard.byte_stop - shard.byte_start}


def _committed(out: OutputDir, shard: Shard) -> str:
    if not with_retries(lambda: out.storage.exists(out.part_path(shard.key)), f"checking shard {shard.key}"):
        return ""
    record = with_retries(lambda: out.summary(shard.key), f"reading the commit record of {shard.key}")
    return json.dumps({**record, **shard_identity(out, shard)})


def _record(out: OutputDir, names: list[str], shards: list[Shard], seconds: float) -> None:
    key = hashlib.sha1("\0".join(names).encode()).hexdigest()[:20]
    data = {"files": len(names), "shards": len(shards), "rows": sum(s.stop - s.start for s in shards),
            "seconds": seconds}
    path = out.storage.path(PLAN_DIR, f"{key}.json")
    with_retries(lambda: out.storage.write_atomic(path, json.dumps(data).encode()), "writing a plan record")
