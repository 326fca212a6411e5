"""What earlier versions of batchinfer wrote, read into today's records: the one module that knows
their shapes. An output's `_job.json` and `manifest.json` come through here once, when the output is
opened (pipeline.io.output.OutputDir); every other module sees today's records only.

A field an earlier record lacks is filled here where today's record has a value that means the same
(`JobRecord.filled` keeps it off storage until a run sets it). Where a missing field means "not known
yet" (no model identity, no input files, no adapters), today's code reads None as that and records
the value on the next run; EARLIER_SHAPES lists those too, so every shape is said once.
"""
from __future__ import annotations

import dataclasses

from pipeline.io.manifest import Manifest
from pipeline.io.records import JobRecord

ROWS_PLAN = "rows"
"""The shard plan of outputs of before shard_bytes: shards every workers.rows_per_batch rows (256 by
default), whole files."""

EARLIER_SHAPES = (
    ("no shard_plan", f"an output of batchinfer before shard_bytes: read as shard_plan {ROWS_PLAN!r}, shards cut every "
                      "workers.rows_per_batch rows (256 by default), whole files"),
    ("shard_plan bytes", "before large files were planned in segments: whole files, shards ended by bytes"),
    ("no numerics", "before outputs recorded them: one with parts is read as {device} alone, on CPU unless its spec "
                    "set workers.gpus; a resume checks the device and records the dtype; one without parts is open"),
    ("no adapters", "no LoRA, or before adapter digests were kept: the next run with adapters records them"),
    ("no ids_unique", "the unique-id check runs once more, then is recorded"),
    ("no ids_duplicate", "no duplicate id was found, or the check ran before the job: it then ran before any shard"),
    ("no plan_blocks", "layout 1, planned in the driver: its shards_planned says how many shards the input has"),
    ("no batchinfer_version", "started by a batchinfer before 0.1.0 recorded its version"),
    ("no model_identity", "before outputs recorded what identifies the model: the next run records its model's"),
    ("no inputs", "before outputs recorded their input files: the next run records the files it finds"),
    ("manifest without index", "layout 1: manifest.json lists every part itself (`parts`); read as layout 1"),
)
"""How a record lacking a field, written by an earlier batchinfer, is read: (which shape, how)."""


def read_job_record(data: dict, has_parts: bool) -> JobRecord:
    """`_job.json` of any version as today's JobRecord. `has_parts`: whether the output holds
    committed parts (an earlier output's numerics are known only from those)."""
    record = JobRecord.from_dict(data)
    filled: dict = {}
    if record.shard_plan is None:
        filled["shard_plan"] = ROWS_PLAN
    if record.numerics is None and has_parts:
        workers = (record.spec or {}).get("workers") or {}
        filled["numerics"] = {"device": "cuda" if workers.get("gpus") else "cpu"}
    return dataclasses.replace(record, **filled, filled=frozenset(filled)) if filled else record


def read_manifest(data: dict) -> Manifest:
    """manifest.json of any layout as today's Manifest."""
    found = Manifest.from_dict(data)
    if "layout" not in data:  # layout 1 wrote none
        found.layout = 1 if found.index is None else 2
    return found
