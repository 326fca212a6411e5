"""Planning as Ray Data tasks: blocks of input files -> shards, streamed to the engine actors.

The driver only lists the input files. Each planning task takes a block of them, reads Parquet
footers and JSONL line ends (pipeline.io.source.plan_file), and emits that block's shards; the
actor pool starts on the first block's shards while later blocks are still being planned, so
no process ever holds the whole plan. A JSONL file larger than SEGMENT_BYTES is planned in byte
segments by parallel tasks (pipeline.io.source.plan_segment); each numbers its lines once a small
actor (LineSequencer) has the line counts of the segments before it.

`batchinfer validate` plans the same shards in its own process, one unit after another
(job_shards), so its counts are the job's.

On a resume a task also marks the shards whose part is already committed (one existence check
per shard, plus its commit record), and the actors pass those through without work. Each task
records what it planned under _plan/, so a partial report can say how many shards the input has.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Iterator, NamedTuple

import pyarrow as pa

from pipeline.errors import InputError
from pipeline.io import ROWS_PLAN, CommitRecord, JobRecord, OutputDir, Shard, Storage, plan_file, plan_segment

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

SEGMENT_BYTES = 256 << 20
"""A JSONL file larger than this is planned in segments of this many bytes, each by its own
task, so one huge file is planned in parallel and its first shards start after one segment.
Recorded in _job.json when an output starts, so a resume cuts the same shards."""

LEGACY_ROWS_PER_SHARD = 256
"""Layout-1 outputs (before shard_bytes) were planned by rows only, 256 by default."""


@dataclass(frozen=True)
class ShardPlan:
    """How an output's input is cut into shards. Fixed when the output starts (_job.json), so
    every resume cuts the same shards, with the same keys."""

    rows: int | None
    """Rows that end a shard (None: no row limit)."""
    bytes: int | None
    """Input bytes that end a shard, at the next line end (None: by rows only)."""
    segment_bytes: int | None = None
    """JSONL files larger than this are planned in segments of this size (None: whole files)."""


def new_plan_record() -> dict:
    """The _job.json fields that fix the shard plan of an output started now."""
    return {"shard_plan": "segments", "segment_bytes": SEGMENT_BYTES}


def shard_plan(spec: JobSpec, record: JobRecord) -> ShardPlan:
    """The shard plan of an output, from its _job.json record: the rows_per_batch and shard_bytes
    of the spec it recorded when it started (a resume may set others: they apply to new outputs).
    Outputs of earlier versions keep theirs: rows only ("rows"), or bytes with whole files
    ("bytes")."""
    rows, size = planned_by(spec, record)
    kind = record.shard_plan
    if kind == ROWS_PLAN:
        return ShardPlan(rows or LEGACY_ROWS_PER_SHARD, None)
    if kind == "bytes":
        return ShardPlan(rows, size)
    if kind == "segments" and isinstance(record.segment_bytes, int):
        return ShardPlan(rows, size, record.segment_bytes)
    raise InputError(f"the output was started by a newer batchinfer (shard plan {kind!r}); "
                     "upgrade batchinfer to resume it, or use --overwrite")


def planned_by(spec: JobSpec, record: JobRecord) -> tuple[int | None, int]:
    """(rows_per_batch, shard_bytes) that cut the output's shards: those of the spec its _job.json
    recorded, where it recorded them, else the job's."""
    recorded = (record.spec or {}).get("workers")
    recorded = recorded if isinstance(recorded, dict) else {}
    rows = recorded.get("rows_per_batch", spec.workers.rows_per_batch)
    size = recorded.get("shard_bytes", spec.workers.shard_bytes)
    return (rows if isinstance(rows, int) and rows > 0 else None,
            size if isinstance(size, int) and size > 0 else spec.workers.shard_bytes)


class Unit(NamedTuple):
    """What a planning task plans: a whole file, or one byte segment of a large JSONL file."""

    path: str
    name: str
    format: str
    size: int | None
    segment: int = 0
    segments: int = 1
    start: int = 0
    stop: int = -1
    """Segment bytes [start, stop); -1 for a whole file."""


def plan_units(files: list, segment_bytes: int | None = None) -> list[Unit]:
    """The units of `files`, in order: JSONL files larger than `segment_bytes` (by the listing's
    sizes) in segments, every other file whole."""
    sizes = getattr(files, "sizes", None) or [None] * len(files)
    units = []
    for (path, name, fmt), size in zip(files, sizes):
        if not segment_bytes or fmt != "jsonl" or size is None or size <= segment_bytes:
            units.append(Unit(path, name, fmt, size))
            continue
        n = -(-size // segment_bytes)
        for k in range(n):
            start, stop = k * segment_bytes, min(size, (k + 1) * segment_bytes)
            units.append(Unit(path, name, fmt, stop - start, k, n, start, stop))
    return units

SHARD_SCHEMA = pa.schema([("file", pa.string()), ("name", pa.string()), ("format", pa.string()),
                          ("start", pa.int64()), ("stop", pa.int64()), ("byte_start", pa.int64()),
                          ("byte_stop", pa.int64()), ("lora_each", pa.bool_()), ("adapter", pa.string()),
                          ("done", pa.bool_())])
"""A planned shard as a Ray Data row: the Shard's fields, and `done`: whether its part is committed.
A `committed` column beside them holds each shard's CommitRecord as a Python object (Ray Data's
object extension type): the record read back for a done shard, an empty one for the others."""


def plan_groups(units: list[Unit]) -> list[list[int]]:
    """The units (indices, in order) each planning task takes: consecutive units, at most
    FILES_PER_PLAN_TASK of them and BYTES_PER_PLAN_TASK bytes, both limits raised as needed to
    stay within MAX_PLAN_BLOCKS tasks. Unit sizes come from the listing (`InputFiles.sizes`)."""
    n = len(units)
    sizes = [u.size for u in units]
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


def unit_shards(storage: Storage, unit: Unit, plan: ShardPlan) -> tuple[list[Shard], int]:
    """A unit's shards, with line numbers counted from the unit's first line, and its line count."""
    if unit.segments > 1:
        return plan_segment(storage, unit.path, unit.name, unit.start, unit.stop, plan.rows, plan.bytes, attempts=5)
    shards = plan_file(storage, unit.path, unit.name, unit.format, plan.rows, plan.bytes, attempts=5)
    return shards, shards[-1].stop if shards else 0


def under_adapters(spec: JobSpec, shards: list[Shard]) -> list[Shard]:
    """With lora.each, every shard once per adapter (a unit of work and of commit each); else the shards."""
    if not spec.lora.each:
        return shards
    return [u for s in shards for u in s.under_adapters(spec.lora.each_adapters)]


def job_shards(spec: JobSpec, files: list, plan: ShardPlan) -> Iterator[Shard]:
    """Every shard of the job, in order, as its planning tasks cut them, planned here in this
    process without Ray (batchinfer validate): a segment's lines numbered after the segments before."""
    storage = Storage(spec.input.path, spec.input.storage_options)
    before: dict[str, int] = {}
    for unit in plan_units(files, plan.segment_bytes):
        shards, lines = unit_shards(storage, unit, plan)
        offset = before.get(unit.name, 0)
        before[unit.name] = offset + lines
        if offset:
            shards = [replace(s, start=s.start + offset, stop=s.stop + offset) for s in shards]
        yield from under_adapters(spec, shards)


def output_plan(spec: JobSpec) -> ShardPlan:
    """The plan a run of `spec` cuts: its output's own (_job.json), else a new output's."""
    record = OutputDir(Storage(spec.output.path, spec.output.storage_options), spec.output.format).open_record()
    return shard_plan(spec, record if record is not None else JobRecord(**new_plan_record()))


def plan_blocks(files: list, segment_bytes: int | None = None) -> int:
    """How many planning tasks plan `files`."""
    return len(plan_groups(plan_units(files, segment_bytes)))


def planned_dataset(spec: JobSpec, files: list[tuple[str, str, str]], resume: bool, plan: ShardPlan):
    """A Ray Dataset of shard rows (SHARD_SCHEMA), planned by Ray tasks as it is consumed."""
    import ray

    # One item per planning task, holding its units, so that the tasks are what plan_groups says.
    units = plan_units(files, plan.segment_bytes)
    groups = plan_groups(units)
    items = [{f: [units[i][k] for i in g] for k, f in enumerate(Unit._fields) if f != "size"} for g in groups]
    blocks = len(groups)
    sequencer = None
    if any(u.segments > 1 for u in units):
        sequencer = ray.remote(num_cpus=0, max_concurrency=100_000)(LineSequencer).remote()
    ds = ray.data.from_items(items, override_num_blocks=blocks)
    # Planning tasks reserve no CPU: they are I/O-bound, and the engine actors may hold every
    # CPU of the cluster (planning would then never be scheduled and the job would hang); at most
    # one runs per CPU of the cluster, so they cannot start hundreds of worker processes. Their
    # memory request, which the actors do not make, keeps Ray Data from fusing planning into the
    # actors: it runs in its own tasks, ahead of the actors, not inside them between shards.
    tasks = max(1, min(blocks, int(ray.cluster_resources().get("CPU", 1))))
    return ds.map_batches(plan_block, fn_kwargs={"spec": spec, "resume": resume, "plan": plan, "sequencer": sequencer},
                          batch_size=None, batch_format="pyarrow", num_cpus=0, memory=PLAN_TASK_MEMORY,
                          compute=ray.data.TaskPoolStrategy(size=tasks))


def plan_block(batch: pa.Table, spec: JobSpec, resume: bool, plan: ShardPlan, sequencer=None) -> pa.Table:
    """Ray Data stage: the shards of a block of units (files or segments), committed ones marked."""
    import ray

    storage = Storage(spec.input.path, spec.input.storage_options)
    out = OutputDir(Storage(spec.output.path, spec.output.storage_options), spec.output.format)
    started = time.perf_counter()
    columns = {f: [v for group in batch.column(f).to_pylist() for v in group] for f in Unit._fields if f != "size"}
    units = [Unit(**{f: columns[f][i] for f in columns}, size=None) for i in range(len(columns["path"]))]
    shards: list[Shard] = []
    for u in units:
        local, lines = unit_shards(storage, u, plan)
        if u.segments > 1:
            before = ray.get(sequencer.offset.remote(u.name, u.segment, lines))
            local = [replace(s, start=s.start + before, stop=s.stop + before) for s in local]
        shards += local
    shards = under_adapters(spec, shards)
    from ray.data.extensions import ArrowPythonObjectArray

    committed = [out.committed(s) if resume else None for s in shards]
    _record(out, units, shards, time.perf_counter() - started)
    columns = {f: [getattr(s, f) for s in shards] for f in SHARD_SCHEMA.names[:-1]}
    table = pa.table({**columns, "done": [c is not None for c in committed]}, schema=SHARD_SCHEMA)
    records = ArrowPythonObjectArray.from_objects([c if c is not None else CommitRecord() for c in committed])
    return table.append_column("committed", records)


def _record(out: OutputDir, units: list[Unit], shards: list[Shard], seconds: float) -> None:
    """What one planning task planned, under _plan/ (for partial reports)."""
    names = [f"{u.name}#{u.segment}" if u.segments > 1 else u.name for u in units]
    data = {"files": sum(u.segment == 0 for u in units), "segments": sum(u.segments > 1 for u in units),
            "shards": len(shards), "rows": sum(s.stop - s.start for s in shards), "seconds": seconds}
    out.write_plan_record(names, data)


class LineSequencer:
    """Numbers the lines of JSONL files planned in segments. Each segment's planning task reports
    its line count and gets back the number of lines before its segment, as soon as every earlier
    segment of the file has reported. One per job, as an async Ray actor that needs no CPU.

    Ray Data starts planning tasks in input order and a task reports before it waits, so the
    earliest segment still unreported is always running: the waits cannot deadlock. A retried
    task reports the same count again, which changes nothing."""

    def __init__(self):
        self._before: dict[str, list[int]] = {}  # file -> lines before segment k, for the k known
        self._counts: dict[str, dict[int, int]] = {}  # file -> counts reported ahead of the known ones
        self._waiting: dict[tuple[str, int], list[asyncio.Future]] = {}

    async def offset(self, name: str, segment: int, lines: int) -> int:
        before = self._before.setdefault(name, [0])
        counts = self._counts.setdefault(name, {})
        if segment >= len(before) - 1:
            counts[segment] = lines
        known = len(before)
        while len(before) - 1 in counts:
            before.append(before[-1] + counts.pop(len(before) - 1))
        for k in range(known, len(before)):
            for future in self._waiting.pop((name, k), []):
                future.set_result(before[k])
        if segment < len(before):
            return before[segment]
        future = asyncio.get_running_loop().create_future()
        self._waiting.setdefault((name, segment), []).append(future)
        return await future
