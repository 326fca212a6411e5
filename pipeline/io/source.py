"""Input side: list files, plan shards (file + row range), read one shard with row ids.

Planning streams: it needs only file listings, Parquet footers and, for JSONL, one pass that
counts newlines in fixed-size blocks (run in Ray tasks, see pipeline.run.shards.planner). A shard is the
unit of work, commit and resume; its size is set by bytes of input (work), capped by rows.
"""
from __future__ import annotations

import hashlib
import json
import posixpath
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.errors import InputError
from pipeline.io.storage import Storage, with_retries
from pipeline.io.text import without_lone_surrogates
from pipeline.spec import Row

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
BLOCK = 8 << 20


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
    """JSONL: byte offset of line `start`. Parquet: the rows' proportional share of the file's
    bytes (it measures progress; reads go by rows)."""
    byte_stop: int = 0
    """JSONL: byte offset just past line `stop - 1`. Parquet: as byte_start."""
    lora_each: bool = False
    """lora.each: this unit is the rows under one adapter (`adapter`; "" = the base model)."""
    adapter: str = ""
    """With lora_each: the adapter its rows run under ("" = the base model)."""

    @property
    def key(self) -> str:
        """Stable identity of the shard: the same input and shard settings give the same keys (a
        lora.each unit's key adds its adapter's name, so an adapter added later gets new keys)."""
        lora = f"\0lora\0{self.adapter}" if self.lora_each else ""
        return hashlib.sha1(f"{self.name}\0{self.start}\0{self.stop}{lora}".encode()).hexdigest()[:20]

    def under_adapters(self, names: list[str]) -> list["Shard"]:
        """lora.each: one unit of this shard per adapter name ("" = the base model)."""
        return [replace(self, lora_each=True, adapter=n) for n in names]

    @classmethod
    def from_batch(cls, batch: dict) -> list["Shard"]:
        """Shards from a Ray Data batch of rows holding the Shard fields (numpy columns)."""
        def plain(value):
            return value.item() if hasattr(value, "item") else value

        names = [f.name for f in fields(cls)]
        return [cls(**{k: plain(batch[k][i]) for k in names}) for i in range(len(batch["file"]))]


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


class InputFiles(list):
    """(path, name relative to the root, format) of every input file, sorted; `total_bytes` is
    their size in all, from the listing itself (None where the filesystem gave no sizes)."""

    total_bytes: int | None = None
    sizes: list[int | None] = []
    """Each file's size in bytes, from the listing (None where it gave none)."""
    tags: list[str | None] = []
    """Each file's ETag, from the listing (object storage; None elsewhere)."""


def list_inputs(storage: Storage, declared_format: str) -> InputFiles:
    """Every input file (see InputFiles), hidden ones left out. Fatal if none."""
    fs, root = storage.fs, storage.root
    if any(ch in root for ch in "*?["):
        base = root[: min(root.index(ch) for ch in "*?[" if ch in root)].rsplit("/", 1)[0]
        found = {p: d for p, d in fs.glob(root, detail=True).items() if d.get("type") != "directory"}
    elif fs.isdir(root):
        base = root
        found = _find(fs, root)
    elif fs.exists(root):
        base, found = posixpath.dirname(root), {root: fs.info(root)}
    else:
        raise InputError(f"input not found: {storage.url}")
    files, sizes, tags = InputFiles(), [], []
    for p in sorted(found):
        name = posixpath.relpath(p, base) if base else p
        if any(part.startswith((".", "_")) for part in name.split("/")):
            continue  # hidden files, _SUCCESS markers and the like
        fmt = file_format(p, declared_format)
        if fmt is not None:
            files.append((p, name, fmt))
            sizes.append(found[p].get("size"))
            tag = found[p].get("ETag") or found[p].get("etag")
            tags.append(str(tag).strip('"') if tag else None)
    if not files:
        raise InputError(f"no input files (.jsonl, .json, .parquet) under {storage.url}")
    files.sizes = [n if isinstance(n, int) else None for n in sizes]
    files.tags = tags
    files.total_bytes = sum(sizes) if all(isinstance(n, int) for n in sizes) else None
    return files


LIST_THREADS = 32
"""Subfolders of the input root listed at once (object-store LISTs are sequential per prefix)."""


def _find(fs, root: str) -> dict:
    """Every file under `root`, with its details: the top level in one listing, then each
    subfolder in a thread of its own, so a partitioned dataset (`date=.../part-*.parquet`) on
    object storage is listed in parallel, one paginated listing per subfolder. Hidden and
    underscore subfolders (`_temporary`, `.cache`) are not descended."""
    found, folders = {}, []
    for entry in fs.ls(root, detail=True):
        path = entry["name"].rstrip("/")
        if path == root.rstrip("/"):
            continue  # some object stores list a folder marker as an entry of itself
        if entry.get("type") == "directory":
            if not posixpath.basename(path).startswith((".", "_")):
                folders.append(path)
        else:
            found[path] = entry
    if folders:
        with ThreadPoolExecutor(min(LIST_THREADS, len(folders))) as pool:
            for part in pool.map(lambda folder: fs.find(folder, detail=True), folders):
                found.update(part)
    return found


def plan_shards(storage: Storage, files, rows_per_shard: int | None,
                shard_bytes: int | None = None) -> Iterator[Shard]:
    """Shards of every file, in file order. A shard ends at the first line end at or after
    `shard_bytes` bytes of the file (Parquet: of its uncompressed data), or after
    `rows_per_shard` rows, whichever comes first (None = no such limit)."""
    if not rows_per_shard and not shard_bytes:
        raise ValueError("plan_shards needs rows_per_shard or shard_bytes")
    for path, name, fmt in files:
        yield from plan_file(storage, path, name, fmt, rows_per_shard, shard_bytes)


def plan_file(storage: Storage, path: str, name: str, fmt: str, rows_per_shard: int | None,
              shard_bytes: int | None, attempts: int = 1) -> list[Shard]:
    """The shards of one file; a read error is retried `attempts` times, then is an InputError."""
    def plan() -> list[Shard]:
        if fmt == "parquet":
            return list(_parquet_shards(storage, path, name, rows_per_shard, shard_bytes))
        return _jsonl_range(storage, path, name, rows_per_shard, shard_bytes, 0, None)[0]

    return _planned(storage, path, plan, f"planning {name}", attempts)


def _planned(storage: Storage, path: str, plan, what: str, attempts: int):
    """plan(), its read errors retried `attempts` times, then raised as an InputError."""
    try:
        return with_retries(plan, what, attempts=attempts)
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"cannot read {storage.uri(path)}: {exc}") from exc


def _parquet_shards(storage: Storage, path: str, name: str, rows: int | None,
                    shard_bytes: int | None) -> Iterator[Shard]:
    with storage.fs.open(path, "rb") as f:
        meta = pq.ParquetFile(f).metadata
        size = getattr(f, "size", None) or storage.fs.size(path)
    total = meta.num_rows
    if shard_bytes:
        data = sum(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups))
        by_bytes = max(1, shard_bytes * total // max(data, 1))
        rows = min(rows, by_bytes) if rows else by_bytes
    for start in range(0, total, rows):
        stop = min(start + rows, total)
        yield Shard(path, name, "parquet", start, stop, size * start // total, size * stop // total)


def _jsonl_range(storage: Storage, path: str, name: str, rows: int | None, shard_bytes: int | None,
                 start: int, stop: int | None) -> tuple[list[Shard], int]:
    """The shards of the lines that start in bytes [start, stop) of a JSONL file (stop None: to
    the end), and their count, line numbers counted from the range's first line. Reads the range
    once, block by block (constant memory), and cuts it at line ends: after `rows` lines or at
    the first line end at or after `shard_bytes` bytes. Lines are counted with bytes.count, so
    the cost is one pass at memory speed, not a Python loop per line."""
    with storage.fs.open(path, "rb") as f:
        first = _line_start(f, start)
        if stop is not None and first >= stop:  # no line starts here (one line spans the range)
            return [], 0
        f.seek(first)
        cut = _Cutter(path, name, rows or 0, shard_bytes or 0, offset=first)
        shards, pos = [], first
        while True:
            block = f.read(BLOCK)
            if not block:
                break
            end = block.find(b"\n", max(0, stop - 1 - pos)) if stop is not None and pos + len(block) >= stop else -1
            shards += cut.feed(block if end < 0 else block[: end + 1])
            if end >= 0:  # the range ends at the first line start at or after `stop`
                break
            pos += len(block)
        shards += cut.finish()
        return shards, cut.line


class _Cutter:
    """The state of one JSONL file's planning: where the open shard starts and its lines so far."""

    def __init__(self, path: str, name: str, rows: int, shard_bytes: int, offset: int = 0):
        self.path, self.name, self.rows, self.shard_bytes = path, name, rows, shard_bytes
        self.offset = offset  # file offset of the current block
        self.line, self.byte = 0, offset  # first line (from where planning started) and byte of the open shard
        self.lines = 0  # complete lines in the open shard so far
        self.last = b"\n"

    def feed(self, block: bytes) -> Iterator[Shard]:
        pos = 0
        while True:
            end = self._byte_cut(block, pos)
            lines = block.count(b"\n", pos, len(block) if end < 0 else end + 1)
            if self.rows and self.lines + lines >= self.rows:
                end = _nth_newline(block, pos, self.rows - self.lines)
                lines = self.rows - self.lines
            elif end < 0:
                self.lines += lines
                break
            yield self._shard(self.lines + lines, self.offset + end + 1)
            pos = end + 1
        self.offset += len(block)
        self.last = block[-1:]

    def _byte_cut(self, block: bytes, pos: int) -> int:
        """Index in `block` of the first newline at or after the shard's byte target; -1 if none."""
        if not self.shard_bytes:
            return -1
        target = self.byte + self.shard_bytes - 1 - self.offset
        return block.find(b"\n", max(pos, target)) if target < len(block) else -1

    def _shard(self, lines: int, stop_byte: int) -> Shard:
        shard = Shard(self.path, self.name, "jsonl", self.line, self.line + lines, self.byte, stop_byte)
        self.line, self.byte, self.lines = self.line + lines, stop_byte, 0
        return shard

    def finish(self) -> Iterator[Shard]:
        lines = self.lines + (self.last != b"\n")  # a last line without a trailing newline
        if lines:
            yield self._shard(lines, self.offset)


def plan_segment(storage: Storage, path: str, name: str, start: int, stop: int, rows_per_shard: int | None,
                 shard_bytes: int | None, attempts: int = 1) -> tuple[list[Shard], int]:
    """The shards of one byte segment [start, stop) of a JSONL file, and its line count. The
    segment holds the lines that start in it, so consecutive segments hold each line once and
    each can be planned without the others. Line numbers count from the segment's first line:
    the caller adds the lines of the segments before it (pipeline.run.shards.planner sequences them)."""
    return _planned(storage, path, lambda: _jsonl_range(storage, path, name, rows_per_shard, shard_bytes, start, stop),
                    f"planning {name} bytes {start}-{stop}", attempts)


def _line_start(f, offset: int) -> int:
    """The first line start at or after `offset` (the file's size if none)."""
    if offset == 0:
        return 0
    f.seek(offset - 1)
    pos = offset - 1
    while True:
        block = f.read(1 << 16)
        if not block:
            return pos
        i = block.find(b"\n")
        if i >= 0:
            return pos + i + 1
        pos += len(block)


def _nth_newline(block: bytes, pos: int, n: int) -> int:
    idx = pos - 1
    for _ in range(n):
        idx = block.find(b"\n", idx + 1)
        if idx < 0:
            return -1
    return idx


def read_shard(storage: Storage, shard: Shard) -> list[Row]:
    """The rows of a shard, each with its derived id (file:line) and its parse error; blank JSONL lines
    are skipped."""
    if shard.format == "parquet":
        try:
            with storage.fs.open(shard.file, "rb") as f:
                table = _parquet_slice(pq.ParquetFile(f), shard.start, shard.stop)
        except pa.ArrowException as exc:  # a short or corrupt read: an OSError, so it is retried
            raise OSError(f"cannot read rows {shard.start}-{shard.stop} of {shard.name}: {exc}") from exc
        if table.num_rows != shard.stop - shard.start:
            raise OSError(f"short read of {shard.name}: {table.num_rows} of {shard.stop - shard.start} rows")
        return [Row(f"{shard.name}:{shard.start + i}", values) for i, values in enumerate(table.to_pylist())]
    with storage.fs.open(shard.file, "rb") as f:
        f.seek(shard.byte_start)
        data = f.read(shard.byte_stop - shard.byte_start)
    if len(data) != shard.byte_stop - shard.byte_start:  # never commit a silently truncated shard
        raise OSError(f"short read of {shard.name}: {len(data)} of {shard.byte_stop - shard.byte_start} bytes")
    rows = []
    for i, raw in enumerate(data.split(b"\n")[: shard.stop - shard.start]):
        if not raw.strip():
            continue
        line = shard.start + i
        try:
            value = json.loads(raw)
            if not isinstance(value, dict):
                raise ValueError(f"expected a JSON object, got {type(value).__name__}")
            rows.append(Row(f"{shard.name}:{line}", without_lone_surrogates(value) if b"\\u" in raw else value))
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            rows.append(Row(f"{shard.name}:{line}", {}, f"{shard.name} line {line + 1}: malformed JSON ({_short(exc)})"))
    return rows


def _parquet_slice(pf: pq.ParquetFile, start: int, stop: int) -> pa.Table:
    groups, first_row, row = [], None, 0
    for g in range(pf.metadata.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if row + n > start and row < stop:
            groups.append(g)
            first_row = row if first_row is None else first_row
        row += n
    if not groups:  # the file has fewer rows than planned: nothing of this range is left
        return pf.schema_arrow.empty_table()
    # One thread: `pf` reads a Python file object, and an Arrow pool thread that dropped the last
    # reference to it after the interpreter began to exit would abort the process (see
    # pipeline.io.output.arrow_owned).
    table = pf.read_row_groups(groups, use_threads=False)
    return table.slice(start - first_row, stop - start)


def read_schema_columns(storage: Storage, path: str, fmt: str) -> list[str]:
    """Column names of the first rows of a file (for fail-fast checks before any actor starts)."""
    with storage.fs.open(path, "rb") as f:
        if fmt == "parquet":
            return pq.ParquetFile(f).schema_arrow.names
        return list(_first_json_row(f))


def read_first_value(storage: Storage, path: str, fmt: str, column: str):
    """The first row's value of `column` in a file (None where it has none), for fail-fast checks."""
    with storage.fs.open(path, "rb") as f:
        if fmt == "parquet":
            values = pq.ParquetFile(f).read_row_group(0, columns=[column]).column(0)
            return values[0].as_py() if len(values) else None
        return _first_json_row(f).get(column)


def _first_json_row(f) -> dict:
    """The first non-blank line of a JSON-lines file as a dict ({} when it is none)."""
    for raw in f:
        if raw.strip():
            try:
                value = json.loads(raw)
            except ValueError:
                return {}
            return value if isinstance(value, dict) else {}
    return {}


def _short(exc: Exception) -> str:
    return str(exc).split("\n")[0][:120]
