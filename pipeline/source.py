"""Input side: list files, plan shards (file + row range), read one shard with row ids.

Planning streams: it needs only file listings, Parquet footers and, for JSONL, one pass that
counts newlines in fixed-size blocks. A shard is the unit of work, commit and resume.
"""
from __future__ import annotations

import hashlib
import json
import posixpath
from dataclasses import asdict, dataclass
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.storage import Storage

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
BLOCK = 8 << 20


class InputError(RuntimeError):
    """The input cannot be used at all (fatal); the message says why in one line."""


@dataclass(frozen=True)
class Shard:
    """A contiguous range of rows of one input file."""

    file: str
    """Path on the input filesystem."""
    name: str
    """The file's name relative to the input root: the stable part of derived row ids."""
    format: str
    """jsonl | parquet"""
    start: int
    """First row (JSONL: line) number, 0-based."""
    stop: int
    """One past the last row."""
    byte_start: int = 0
    """JSONL only: byte offset of line `start`."""
    byte_stop: int = 0
    """JSONL only: byte offset just past line `stop - 1`."""

    @property
    def key(self) -> str:
        """Stable identity of the shard: the same input and rows_per_batch give the same keys."""
        return hashlib.sha1(f"{self.name}\0{self.start}\0{self.stop}".encode()).hexdigest()[:20]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_batch(cls, batch: dict) -> list["Shard"]:
        """Shards from a Ray Data batch of `to_dict()` rows (numpy columns)."""
        def plain(value):
            return value.item() if hasattr(value, "item") else value

        return [cls(**{k: plain(v[i]) for k, v in batch.items()}) for i in range(len(batch["file"]))]


def file_format(path: str, declared: str) -> str | None:
    if declared == "openai_batch":
        return "jsonl"  # OpenAI Batch files are JSONL; the worker reads the request lines
    if declared != "auto":
        return declared
    lower = path.lower()
    if lower.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if lower.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return None


def list_inputs(storage: Storage, declared_format: str) -> list[tuple[str, str, str]]:
    """(path, name relative to the root, format) of every input file, sorted. Fatal if none."""
    fs, root = storage.fs, storage.root
    if any(ch in root for ch in "*?["):
        base = root[: min(root.index(ch) for ch in "*?[" if ch in root)].rsplit("/", 1)[0]
        paths = sorted(p for p in fs.glob(root) if fs.isfile(p))
    elif fs.isdir(root):
        base = root
        paths = sorted(fs.find(root))
    elif fs.exists(root):
        base, paths = posixpath.dirname(root), [root]
    else:
        raise InputError(f"input not found: {storage.url}")
    files = []
    for p in paths:
        name = posixpath.relpath(p, base) if base else p
        if any(part.startswith((".", "_")) for part in name.split("/")):
            continue  # hidden files, _SUCCESS markers and the like
        fmt = file_format(p, declared_format)
        if fmt is not None:
            files.append((p, name, fmt))
    if not files:
        raise InputError(f"no input files (.jsonl, .json, .parquet) under {storage.url}")
    return files


def plan_shards(storage: Storage, files, rows_per_shard: int) -> Iterator[Shard]:
    for path, name, fmt in files:
        try:
            if fmt == "parquet":
                yield from _parquet_shards(storage, path, name, rows_per_shard)
            else:
                yield from _jsonl_shards(storage, path, name, rows_per_shard)
        except (OSError, pa.ArrowException) as exc:
            raise InputError(f"cannot read {storage.uri(path)}: {exc}") from exc


def _parquet_shards(storage: Storage, path: str, name: str, rows: int) -> Iterator[Shard]:
    with storage.fs.open(path, "rb") as f:
        total = pq.ParquetFile(f).metadata.num_rows
    for start in range(0, total, rows):
        yield Shard(path, name, "parquet", start, min(start + rows, total))


def _jsonl_shards(storage: Storage, path: str, name: str, rows: int) -> Iterator[Shard]:
    """Splits at every `rows`-th newline, found block by block (constant memory)."""
    line = 0
    offset = 0
    shard_line, shard_byte = 0, 0
    last_byte = b"\n"
    with storage.fs.open(path, "rb") as f:
        while True:
            block = f.read(BLOCK)
            if not block:
                break
            pos = 0
            while True:
                need = rows - (line - shard_line)
                idx = _nth_newline(block, pos, need)
                if idx < 0:
                    line += block.count(b"\n", pos)
                    break
                line += need
                end = offset + idx + 1
                yield Shard(path, name, "jsonl", shard_line, line, shard_byte, end)
                shard_line, shard_byte = line, end
                pos = idx + 1
            offset += len(block)
            last_byte = block[-1:]
    if last_byte != b"\n":
        line += 1  # a last line without a trailing newline
    if line > shard_line:
        yield Shard(path, name, "jsonl", shard_line, line, shard_byte, offset)


def _nth_newline(block: bytes, pos: int, n: int) -> int:
    idx = pos - 1
    for _ in range(n):
        idx = block.find(b"\n", idx + 1)
        if idx < 0:
            return -1
    return idx


def read_shard(storage: Storage, shard: Shard) -> tuple[list[dict], list[str], list[str | None]]:
    """(rows, derived ids, per-row parse errors) of a shard; blank JSONL lines are skipped."""
    if shard.format == "parquet":
        with storage.fs.open(shard.file, "rb") as f:
            table = _parquet_slice(pq.ParquetFile(f), shard.start, shard.stop)
        if table.num_rows != shard.stop - shard.start:
            raise OSError(f"short read of {shard.name}: {table.num_rows} of {shard.stop - shard.start} rows")
        rows = table.to_pylist()
        return rows, [f"{shard.name}:{shard.start + i}" for i in range(len(rows))], [None] * len(rows)
    with storage.fs.open(shard.file, "rb") as f:
        f.seek(shard.byte_start)
        data = f.read(shard.byte_stop - shard.byte_start)
    if len(data) != shard.byte_stop - shard.byte_start:  # never commit a silently truncated shard
        raise OSError(f"short read of {shard.name}: {len(data)} of {shard.byte_stop - shard.byte_start} bytes")
    rows, ids, errors = [], [], []
    for i, raw in enumerate(data.split(b"\n")[: shard.stop - shard.start]):
        if not raw.strip():
            continue
        line = shard.start + i
        ids.append(f"{shard.name}:{line}")
        try:
            value = json.loads(raw)
            if not isinstance(value, dict):
                raise ValueError(f"expected a JSON object, got {type(value).__name__}")
            rows.append(value)
            errors.append(None)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            rows.append({})
            errors.append(f"{shard.name} line {line + 1}: malformed JSON ({_short(exc)})")
    return rows, ids, errors


def _parquet_slice(pf: pq.ParquetFile, start: int, stop: int) -> pa.Table:
    groups, first_row, row = [], None, 0
    for g in range(pf.metadata.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if row + n > start and row < stop:
            groups.append(g)
            first_row = row if first_row is None else first_row
        row += n
    table = pf.read_row_groups(groups)
    return table.slice(start - first_row, stop - start)


def read_schema_columns(storage: Storage, path: str, fmt: str) -> list[str]:
    """Column names of the first rows of a file (for fail-fast checks before any actor starts)."""
    with storage.fs.open(path, "rb") as f:
        if fmt == "parquet":
            return pq.ParquetFile(f).schema_arrow.names
        for raw in f:
            if raw.strip():
                try:
                    value = json.loads(raw)
                except ValueError:
                    return []
                return list(value) if isinstance(value, dict) else []
    return []


def _short(exc: Exception) -> str:
    return str(exc).split("\n")[0][:120]
