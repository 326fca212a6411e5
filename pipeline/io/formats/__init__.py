"""One module per format, each with the same calls (pipeline/io/formats/<format>.py):

- input (parquet, jsonl): `plan(storage, path, name, rows, shard_bytes) -> [Shard]` (jsonl also
  `plan_range` for a byte segment), `read(storage, shard) -> [Row]`, `columns(f)` and
  `first_value(f, column)` for the checks before a job starts, `SUFFIXES` for `input.format: auto`;
- output (parquet, jsonl, openai_batch): `encode(table) -> bytes`, `decode(bytes) -> table`,
  `count(table) -> CommitRecord`; openai_batch's `finish(out, parts)` writes the files a complete
  job adds (output.jsonl, errors.jsonl).

An OpenAI Batch input file is JSONL: it is read by the jsonl reader, and its request lines are
parsed by the task (pipeline.tasks.openai_batch), which needs the engine's sampling parameters.
"""
from __future__ import annotations

from types import ModuleType

from pipeline.io.formats import jsonl, openai_batch, parquet

WRITERS: dict[str, ModuleType] = {"parquet": parquet, "jsonl": jsonl, "openai_batch": openai_batch}
"""output.format -> its module."""

READERS: dict[str, ModuleType] = {"parquet": parquet, "jsonl": jsonl, "openai_batch": jsonl}
"""A file's format (input.format, or what `auto` found) -> the module that plans and reads it."""


def reader(fmt: str) -> ModuleType:
    return READERS[fmt]


def writer(fmt: str) -> ModuleType:
    return WRITERS[fmt]


__all__ = ["READERS", "WRITERS", "jsonl", "openai_batch", "parquet", "reader", "writer"]
