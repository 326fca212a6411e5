"""Where rows live: storage, the input's files and shards, and the output directory's whole layout
(parts, commit and run records, `_plan/`, `_runs/`, `_lock.json`, the part index). fsspec and
pyarrow only: no engine, no Ray. OutputDir owns every file of an output."""
from pipeline.errors import InputError, LockHeld
from pipeline.io import formats
from pipeline.io.adapters import list_adapters
from pipeline.io.index import INDEX_DIR, LAYOUT, IndexWriter, entries, part_entries
from pipeline.io.lock import RunLock, owned_by
from pipeline.io.formats.parquet import arrow_owned
from pipeline.io.output import FINAL_FILES, PLAN_DIR, RUNS_DIR, OutputDir, decode, encode
from pipeline.io.earlier import EARLIER_SHAPES, ROWS_PLAN
from pipeline.io.manifest import Manifest
from pipeline.io.records import JOB_RECORD, SUMMARY_FIELDS, CommitRecord, JobRecord, RunRecord
from pipeline.io.source import (InputFiles, Shard, list_inputs, plan_file, plan_segment, plan_shards, read_first_value, read_schema_columns,
                                read_shard)
from pipeline.io.schema_files import load_schema, read_schema_files
from pipeline.io.storage import Storage, redact, redact_spec, scrub, secret_values, with_retries

__all__ = ["formats", "FINAL_FILES", "INDEX_DIR", "LAYOUT", "PLAN_DIR", "RUNS_DIR", "SUMMARY_FIELDS", "CommitRecord", "JobRecord", "JOB_RECORD", "EARLIER_SHAPES", "Manifest", "ROWS_PLAN", "arrow_owned", "decode", "encode", "IndexWriter",
           "InputError", "InputFiles", "LockHeld", "OutputDir", "RunLock", "RunRecord", "Shard", "Storage", "entries",
           "list_inputs", "list_adapters", "load_schema", "owned_by", "part_entries", "plan_file", "plan_segment", "plan_shards", "read_first_value", "read_schema_columns", "read_schema_files", "read_shard",
           "redact", "redact_spec", "scrub", "secret_values", "with_retries"]
