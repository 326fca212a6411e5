"""The owner of an output directory: every file under it goes through OutputDir, as typed records
(the JobRecord, run and commit records, the plan records, the manifest). Parts are committed
atomically per shard; the job record changes in one method; earlier versions' records are read into
today's once, when they are opened (pipeline.io.earlier).

Layout of an output directory:
    _job.json             the spec fingerprint: a rerun with another spec is refused
    data/part-<key>.*     one part per input shard, written whole or not at all
    _progress/<key>.json  the shard's commit record (counts, times), written after its part
    _plan/<block>.json    shards and rows planned by one planning task (for partial reports)
    _runs/<run>.json      a run's record: times, counts, resources (for usage and cost)
    _lock.json            the run lock of the run writing the output (pipeline.io.lock)
    _index/<run>/*.jsonl  the part index: one line per committed shard (see pipeline.io.index)
    metrics.json          task eval: metrics over the committed scores (written when complete)
    output.jsonl          openai_batch: every line, in input order (written when complete)
    errors.jsonl          openai_batch: the failed requests' lines (written when complete)
    manifest.json         counts, timings, versions, a pointer to the index (written when complete)
    _SUCCESS              written last
"""
from __future__ import annotations

import hashlib
import json
import posixpath

import pyarrow as pa

from pipeline.io.earlier import read_job_record, read_manifest
from pipeline.io.formats import openai_batch, writer
from pipeline.io.manifest import Manifest
from pipeline.io.records import JOB_RECORD, CommitRecord, JobRecord, RunRecord
from pipeline.io.shard import Shard
from pipeline.io.storage import Storage, with_retries

FINAL_FILES = ("metrics.json", openai_batch.OUTPUT_FILE, openai_batch.ERROR_FILE)
"""Written from the committed parts once every shard is done (by task / format)."""

PLAN_DIR = "_plan"
"""Planning records, one per planning task."""

RUNS_DIR = "_runs"
"""Run records, one per run."""

MANIFEST = "manifest.json"


class OutputDir:
    """One job's output directory."""

    def __init__(self, storage: Storage, fmt: str):
        self.storage = storage
        self.format = fmt
        self.ext = "parquet" if fmt == "parquet" else "jsonl"
        self.record: JobRecord | None = None
        """The job record, once `open_record` read it (or `start_record` wrote it)."""

    # -- paths ----------------------------------------------------------------------------------

    def part_path(self, key: str) -> str:
        return self.storage.path("data", f"part-{key}.{self.ext}")

    def progress_path(self, key: str) -> str:
        return self.storage.path("_progress", f"{key}.json")

    def identity(self, shard: Shard) -> dict:
        """The fields of a commit record that say which shard and part it is."""
        return {"shard": shard.key, "path": self.storage.uri(self.part_path(shard.key)), "file": shard.name,
                "start": shard.start, "stop": shard.stop, "bytes": shard.byte_stop - shard.byte_start}

    # -- the job record and the manifest ------------------------------------------------------------

    def open_record(self) -> JobRecord | None:
        """The output's job record as today's JobRecord (None: no job started this output)."""
        data = self.read_json(JOB_RECORD)
        self.record = None if data is None else read_job_record(data, has_parts=self.has_parts())
        return self.record

    def start_record(self, record: JobRecord) -> JobRecord:
        """The job record of an output started now, saved."""
        self.record = record
        self.write_json(JOB_RECORD, record.to_dict())
        return record

    def change_record(self, **changes) -> JobRecord:
        """The one place the job record changes: `changes` set and saved (nothing written when they
        change nothing)."""
        if self.record is None:
            raise RuntimeError("change_record before open_record or start_record")
        changed = self.record.changed(**changes)
        if changed != self.record or changed.to_dict() != self.record.to_dict():
            self.write_json(JOB_RECORD, changed.to_dict())
        self.record = changed
        return changed

    def read_manifest(self) -> Manifest | None:
        """manifest.json as today's Manifest (None until a job completed)."""
        data = self.read_json(MANIFEST)
        return None if data is None else read_manifest(data)

    def write_manifest(self, manifest: Manifest) -> None:
        self.write_json(MANIFEST, manifest.to_dict())

    def planned_shards(self) -> int | None:
        """Shards of the whole input, once every planning task of the latest run has recorded its
        count (else None)."""
        if self.record is None:
            return None
        if self.record.plan_blocks is None:
            return self.record.shards_planned  # layout 1: planned in the driver, which recorded the count
        plan = self.plan_summary(self.record.plan_blocks)
        return plan["shards"] if plan else None

    def read_json(self, name: str) -> dict | None:
        path = self.storage.path(name)
        return json.loads(self.storage.read_text(path)) if self.storage.exists(path) else None

    def write_json(self, name: str, data: dict) -> None:
        self.storage.write_atomic(self.storage.path(name), json.dumps(data, indent=1, default=str).encode())

    def is_complete(self) -> bool:
        return self.storage.exists(self.storage.path("_SUCCESS"))

    def mark_success(self) -> None:
        self.storage.write_atomic(self.storage.path("_SUCCESS"), b"")

    def reopen(self) -> None:
        """A complete output that has more to compute (an adapter added to a lora.each job) is not
        complete any more: its _SUCCESS marker goes; parts and records stay."""
        if self.is_complete():
            self.storage.fs.rm(self.storage.path("_SUCCESS"))

    def clear(self) -> None:
        """Deletes what an earlier job left (--overwrite): its parts, records, plan, index, final
        files and its runs' records, whose time and cost belong to that job, not the next."""
        self.record = None
        for name in ("_SUCCESS", MANIFEST, JOB_RECORD, *FINAL_FILES):
            path = self.storage.path(name)
            if self.storage.exists(path):
                self.storage.fs.rm(path)
        for sub in ("data", "_progress", PLAN_DIR, "_index", RUNS_DIR):
            self.storage.remove_tree(self.storage.path(sub))

    # -- parts ----------------------------------------------------------------------------------

    def has_parts(self) -> bool:
        """Whether an earlier run left anything under data/ (a resume)."""
        return self.storage.exists(self.storage.path("data"))

    def done_keys(self) -> set[str]:
        """Keys of the shards whose part is committed (one entry per shard, not per row)."""
        keys = set()
        for path in self.storage.list(self.storage.path("data")):
            name = posixpath.basename(path)
            if name.startswith("part-") and name.endswith("." + self.ext):
                keys.add(name[len("part-"): -len(self.ext) - 1])
        return keys

    def commit(self, key: str, table: pa.Table, record: CommitRecord) -> str:
        """Writes the shard's part (atomically), then its commit record. Returns the part path."""
        path = self.part_path(key)
        self.storage.write_atomic(path, encode(table, self.format))
        self.storage.write_atomic(self.progress_path(key), record.to_json().encode())
        return path

    def summary(self, key: str) -> CommitRecord:
        """A committed shard's record: as written with its part, or recounted from the part if the
        job died between the two writes."""
        path = self.progress_path(key)
        if self.storage.exists(path):
            return CommitRecord.from_json(self.storage.read_text(path))
        record = self.counted(self.read_part(key))
        self.storage.write_atomic(path, record.to_json().encode())
        return record

    def committed(self, shard: Shard) -> CommitRecord | None:
        """The commit record of `shard` if its part is committed, else None (storage errors retried)."""
        if not with_retries(lambda: self.storage.exists(self.part_path(shard.key)), f"checking shard {shard.key}"):
            return None
        record = with_retries(lambda: self.summary(shard.key), f"reading the commit record of {shard.key}")
        return CommitRecord.from_dict({**record.to_dict(), **self.identity(shard)})

    def read_part(self, key: str) -> pa.Table:
        return decode(self.storage.read_bytes(self.part_path(key)), self.format)

    def finish(self, parts) -> dict | None:
        """The files a complete job adds in its format, from its committed parts (index entries):
        what the manifest says of them (None: the format adds none)."""
        return writer(self.format).finish(self, parts)

    def counted(self, table: pa.Table) -> CommitRecord:
        """The counts over a part's table (identity and times left unset), by its format."""
        return writer(self.format).count(table)

    # -- runs and planning ----------------------------------------------------------------------

    def write_run(self, run: RunRecord) -> None:
        run.touch()
        self.storage.write_atomic(self.storage.path(RUNS_DIR, f"{run.run_id}.json"), json.dumps(run.to_dict()).encode())

    def read_runs(self) -> list[RunRecord]:
        runs = []
        for path in self.storage.list(self.storage.path(RUNS_DIR)):
            if posixpath.basename(path).endswith(".json"):
                runs.append(RunRecord.from_dict(json.loads(self.storage.read_text(path))))
        return sorted(runs, key=lambda r: r.started)

    def write_plan_record(self, names: list[str], data: dict) -> None:
        """The record of one planning task, named after the units it planned (`names`), so that a
        retried task overwrites its own record."""
        key = hashlib.sha1("\0".join(names).encode()).hexdigest()[:20]
        path = self.storage.path(PLAN_DIR, f"{key}.json")
        with_retries(lambda: self.storage.write_atomic(path, json.dumps(data).encode()), "writing a plan record")

    def plan_summary(self, plan_blocks: int | None) -> dict | None:
        """Sums of the planning records (tasks, files, shards, rows, seconds of task time), or None
        while fewer than `plan_blocks` planning tasks (the current run's) have recorded."""
        records = [p for p in self.storage.list(self.storage.path(PLAN_DIR)) if p.endswith(".json")]
        if len(records) != plan_blocks:
            return None
        total = {"tasks": len(records), "files": 0, "shards": 0, "rows": 0, "seconds": 0.0}
        for path in records:
            data = json.loads(self.storage.read_text(path))
            for k in ("files", "shards", "rows", "seconds"):
                total[k] += data.get(k, 0)
        return total


def decode(data: bytes, fmt: str) -> pa.Table:
    """A part's table from its bytes (the inverse of `encode`)."""
    return writer(fmt).decode(data)


def encode(table: pa.Table, fmt: str) -> bytes:
    """A part's bytes in output format `fmt`."""
    return writer(fmt).encode(table)
