"""The unique-id check of input.id_column: beside the work, at any input size, with no process
holding every id.

Ray tasks read the id column of the input, one planning block of files at a time (the blocks the
job plans by: pipeline.run.shards.planner.plan_groups), hash each id to 16 bytes (BLAKE2b) and split the
hashes into `parts` partitions by their first bytes; then one task per partition sorts its hashes
and finds the first one found twice. The driver holds object references only, and receives the
two places (file and row) of a duplicate: it reads the id at the first to name it.

The tasks reserve no CPU (the engine actors may hold every one) and at most a quarter of the
cluster's CPUs' worth of them run at once, so the check runs while shards are generated and
costs the job little: `IdCheck` runs them from a driver thread. The output is never marked
complete before the check has passed; a duplicate stops the job (pipeline.run.driver).

Memory: a map task holds its block's hashes (28 bytes per id: hash, file, row); a partition task
holds ids / parts of them; `parts` grows with the input (one per block of files or 256 MiB, at
most 256). At 10^9 ids, about 4 M hashes (110 MB; 4 times that while sorted) per partition task.
"""
from __future__ import annotations

import hashlib
import threading
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pipeline.errors import InputError, JobError
from pipeline.io import Storage, read_shard, with_retries
from pipeline.run.shards.planner import PLAN_TASK_MEMORY, ShardPlan, Unit, plan_groups, plan_units, unit_shards
from pipeline.run.shards.ray_env import worker_cause

if TYPE_CHECKING:
    from pipeline.spec import JobSpec

HASHES = np.dtype([("hi", ">u8"), ("lo", ">u8"), ("unit", "<i4"), ("row", "<i8")])
"""One id as the check holds it: its 128-bit hash (two halves), the unit (file or segment) and row."""

BYTES_PER_PART = 256 << 20
"""Input bytes per partition of the hashes at most (as far as the listing gives sizes); there are
at least as many partitions as blocks of files, so each holds about a block's ids."""

MAX_PARTS = 256


@dataclass(frozen=True)
class Place:
    """Where a row is: the unit (file, or segment of a large JSONL file) and its row there."""

    name: str
    start: int
    """The segment's first byte; 0 for a whole file."""
    segmented: bool
    row: int

    def __str__(self) -> str:
        if self.segmented:
            return f"{self.name} line {self.row} after byte {self.start}"
        return f"{self.name} row {self.row}"

    def to_json(self) -> list:
        return [self.name, self.start, self.segmented, self.row]

    @classmethod
    def from_json(cls, data) -> Place:
        name, start, segmented, row = data
        return cls(str(name), int(start), bool(segmented), int(row))


@dataclass(frozen=True)
class Duplicate:
    """An id found twice, and where."""

    id: str
    column: str
    places: tuple[Place, Place]

    def line(self) -> str:
        return (f"duplicate id {self.id!r} in column {self.column!r}: {self.places[0]} and {self.places[1]} "
                "(ids must be unique)")

    def to_json(self) -> dict:
        return {"id": self.id, "column": self.column, "places": [p.to_json() for p in self.places],
                "line": self.line()}

    @classmethod
    def from_json(cls, data: dict) -> Duplicate:
        a, b = (Place.from_json(p) for p in data["places"])
        return cls(str(data["id"]), str(data["column"]), (a, b))


def check_unique_ids(spec: JobSpec, files: list, plan: ShardPlan) -> None:
    """Raises JobError naming the first duplicate id and its two places (Ray must be initialised)."""
    found = find_duplicate(spec, files, plan)
    if found is not None:
        raise JobError(found.line())


def find_duplicate(spec: JobSpec, files: list, plan: ShardPlan, cancelled=lambda: False) -> Duplicate | None:
    """A duplicate of input.id_column, or None once every id was seen once (Ray must be
    initialised). `cancelled()` true: stops between tasks and returns None."""
    import ray

    units = plan_units(files, plan.segment_bytes)
    groups = [g for g in plan_groups(units) if g]
    if not groups:
        return None
    known = [u.size for u in units if u.size is not None]
    parts = max(1, min(MAX_PARTS, max(len(groups), -(-sum(known) // BYTES_PER_PART))))
    window = max(1, int(ray.cluster_resources().get("CPU", 1)) // 4)
    digest = ray.remote(num_cpus=0, memory=PLAN_TASK_MEMORY, num_returns=parts, max_retries=3)(hash_ids)
    spec_ref = ray.put(spec)
    outputs: list[list] = []  # per map task: `parts` refs
    running: list = []
    for group in groups:
        while len(running) >= window:
            done, running = ray.wait(running, num_returns=1)
            ray.get(done)  # raises a task's failure now
            if cancelled():
                return None
        refs = digest.remote(spec_ref, [units[i] for i in group], group[0], plan, parts)
        refs = refs if parts > 1 else [refs]
        outputs.append(refs)
        running.append(refs[0])
    ray.get(running)
    if cancelled():
        return None
    reduce = ray.remote(num_cpus=0, max_retries=3)(first_duplicate)
    pending, found = [], None
    for p in range(parts + 1):
        while pending and (len(pending) >= window or p == parts):
            done, pending = ray.wait(pending, num_returns=1)
            found = ray.get(done[0])
            if found is not None or cancelled():
                break
        if found is not None or cancelled() or p == parts:
            break
        pending.append(reduce.remote(*[refs[p] for refs in outputs]))
    if found is None:
        return None
    places = tuple(_place(units, unit, row) for unit, row in found)
    return Duplicate(id_at(spec, units, found[0][0], found[0][1], plan), spec.input.id_column, places)


def hash_ids(spec: JobSpec, units: list[Unit], first: int, plan: ShardPlan, parts: int):
    """Ray task: the hashes of the ids of `units` (numbered from `first`), one array per partition."""
    storage = Storage(spec.input.path, spec.input.storage_options)
    column = spec.input.id_column
    keys, where, rows = bytearray(), array("i"), array("q")
    for k, unit in enumerate(units):
        for row, value in _ids(storage, unit, column, plan):
            keys += hashlib.blake2b(str(value).encode(), digest_size=16).digest()
            where.append(first + k)
            rows.append(row)
    halves = np.frombuffer(bytes(keys), dtype=">u8").reshape(-1, 2)
    table = np.empty(len(rows), HASHES)
    table["hi"], table["lo"] = halves[:, 0], halves[:, 1]
    table["unit"], table["row"] = np.frombuffer(where, dtype="i4"), np.frombuffer(rows, dtype="i8")
    if parts == 1:
        return table
    which = table["hi"] % np.uint64(parts)
    return [table[which == p] for p in range(parts)]


def first_duplicate(*tables) -> tuple | None:
    """Ray task: of one partition's hashes, the first hash (by where it occurs first) seen twice,
    as its two places ((unit, row), (unit, row)); None if each occurs once."""
    table = np.concatenate(tables) if tables else np.empty(0, HASHES)
    if len(table) < 2:
        return None
    table = table[np.lexsort((table["row"], table["unit"], table["lo"], table["hi"]))]
    same = (table["hi"][1:] == table["hi"][:-1]) & (table["lo"][1:] == table["lo"][:-1])
    if not same.any():
        return None
    at = np.flatnonzero(same)
    # of the pairs (a hash's first two places), the one whose first place comes first in the input
    firsts = at[~np.isin(at - 1, at)]  # each repeated hash's first pair only
    best = min(firsts, key=lambda i: (int(table["unit"][i]), int(table["row"][i])))
    a, b = table[best], table[best + 1]
    return (int(a["unit"]), int(a["row"])), (int(b["unit"]), int(b["row"]))


def _ids(storage: Storage, unit: Unit, column: str, plan: ShardPlan):
    """(row, id) of a unit's rows that have an id; a Parquet file's id column alone is read."""
    if unit.format == "parquet":
        import pyarrow.parquet as pq

        def read():
            with storage.fs.open(unit.path, "rb") as f:
                parquet = pq.ParquetFile(f)
                if column not in parquet.schema_arrow.names:
                    return []  # rows without an id: the job reports each
                return parquet.read(columns=[column]).column(0).to_pylist()

        values = with_retries(read, f"reading {unit.name}")
        for row, value in enumerate(values):
            if value is not None:
                yield row, value
        return
    for shard in unit_shards(storage, unit, plan)[0]:
        for row in with_retries(lambda: read_shard(storage, shard), f"reading {shard.name}"):
            if row.get(column) is not None:
                yield int(row.id.rsplit(":", 1)[1]), row.get(column)


def _place(units: list[Unit], unit: int, row: int) -> Place:
    u = units[unit]
    return Place(u.name, u.start if u.segments > 1 else 0, u.segments > 1, row)


def id_at(spec: JobSpec, units: list[Unit], unit: int, row: int, plan: ShardPlan) -> str | None:
    """The id at a row of a unit, as the check reads it; None where the row or its id is gone."""
    storage = Storage(spec.input.path, spec.input.storage_options)
    try:
        for r, value in _ids(storage, units[unit], spec.input.id_column, plan):
            if r == row:
                return str(value)
    except (OSError, InputError):
        return None
    return None


def still_duplicated(spec: JobSpec, files: list, plan: ShardPlan, recorded: dict) -> Duplicate | None:
    """The duplicate an earlier run recorded, if both its places still hold that id (the input
    unchanged there); None otherwise, or where the record cannot be read."""
    try:
        dup = Duplicate.from_json(recorded)
    except (KeyError, TypeError, ValueError):
        return None
    units = plan_units(files, plan.segment_bytes)
    for place in dup.places:
        at = [i for i in range(len(units)) if _place(units, i, place.row) == place]
        if not at or id_at(spec, units, at[0], place.row, plan) != dup.id:
            return None
    return dup


class IdCheck:
    """find_duplicate in a driver thread, beside the work: `failure()` is its JobError once it
    found a duplicate (or could not read the input), `wait()` blocks until it is done."""

    def __init__(self, spec: JobSpec, files: list, plan: ShardPlan):
        self.duplicate: Duplicate | None = None
        self._error: JobError | None = None
        self._stop = threading.Event()
        self._callbacks: list = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, args=(spec, files, plan), name="id-check", daemon=True)
        self._thread.start()

    def _run(self, spec, files, plan) -> None:
        try:
            self.duplicate = find_duplicate(spec, files, plan, cancelled=self._stop.is_set)
        except Exception as exc:  # an unreadable file: the cause in one line
            self._fail(JobError(worker_cause(exc)))
            return
        if self.duplicate is not None:
            self._fail(JobError(self.duplicate.line()))

    def _fail(self, error: JobError) -> None:
        with self._lock:
            self._error = error
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(error)

    def on_failure(self, callback) -> None:
        """callback(error) once the check fails (now, if it has)."""
        with self._lock:
            if self._error is None:
                self._callbacks.append(callback)
                return
        callback(self._error)

    def failure(self) -> JobError | None:
        return self._error

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Blocks until the check is done; raises its failure."""
        self._thread.join()
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        """Stops the check between its tasks (the job failed for another reason)."""
        self._stop.set()
