"""Input side: list files, plan shards (file + row range), read one shard with row ids; each
format's own planning and reading is its module's (pipeline/io/formats/).

Planning streams: it needs only file listings, Parquet footers and, for JSONL, one pass that
counts newlines in fixed-size blocks (run in Ray tasks, see pipeline.run.shards.planner). A shard is the
unit of work, commit and resume; its size is set by bytes of input (work), capped by rows.
"""
from __future__ import annotations

import posixpath
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import pyarrow as pa

from pipeline.errors import InputError
from pipeline.io.formats import jsonl, parquet, reader
from pipeline.io.shard import Shard
from pipeline.io.storage import Storage, with_retries
from pipeline.spec import Row

JSONL_SUFFIXES = jsonl.SUFFIXES
PARQUET_SUFFIXES = parquet.SUFFIXES


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
    return _planned(storage, path, lambda: reader(fmt).plan(storage, path, name, rows_per_shard, shard_bytes),
                    f"planning {name}", attempts)


def _planned(storage: Storage, path: str, plan, what: str, attempts: int):
    """plan(), its read errors retried `attempts` times, then raised as an InputError."""
    try:
        return with_retries(plan, what, attempts=attempts)
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"cannot read {storage.uri(path)}: {exc}") from exc


def plan_segment(storage: Storage, path: str, name: str, start: int, stop: int, rows_per_shard: int | None,
                 shard_bytes: int | None, attempts: int = 1) -> tuple[list[Shard], int]:
    """The shards of one byte segment [start, stop) of a JSONL file, and its line count. The
    segment holds the lines that start in it, so consecutive segments hold each line once and
    each can be planned without the others. Line numbers count from the segment's first line:
    the caller adds the lines of the segments before it (pipeline.run.shards.planner sequences them)."""
    return _planned(storage, path, lambda: jsonl.plan_range(storage, path, name, rows_per_shard, shard_bytes,
                                                                    start, stop),
                    f"planning {name} bytes {start}-{stop}", attempts)


def read_shard(storage: Storage, shard: Shard) -> list[Row]:
    """The rows of a shard, each with its derived id (file:line or file:row) and its parse error;
    blank JSONL lines are skipped."""
    return reader(shard.format).read(storage, shard)


def read_schema_columns(storage: Storage, path: str, fmt: str) -> list[str]:
    """Column names of the first rows of a file (for fail-fast checks before any actor starts)."""
    with storage.fs.open(path, "rb") as f:
        return reader(fmt).columns(f)


def read_first_value(storage: Storage, path: str, fmt: str, column: str):
    """The first row's value of `column` in a file (None where it has none), for fail-fast checks."""
    with storage.fs.open(path, "rb") as f:
        return reader(fmt).first_value(f, column)
