"""JSONL: one JSON object a line. Input: planned by counting newlines in fixed-size blocks (one pass
at memory speed, in segments for large files), read by byte range. Output: one row a line."""
from __future__ import annotations

import json
from typing import Iterator

import pyarrow as pa

from pipeline.io.records import CommitRecord
from pipeline.io.shard import Shard
from pipeline.io.storage import Storage
from pipeline.io.text import without_lone_surrogates
from pipeline.spec import Row

SUFFIXES = (".jsonl", ".json", ".ndjson")
BLOCK = 8 << 20
"""Bytes read at a time while planning."""


def plan(storage: Storage, path: str, name: str, rows: int | None, shard_bytes: int | None) -> list[Shard]:
    """The shards of a whole JSONL file (plan_range over all of it)."""
    return plan_range(storage, path, name, rows, shard_bytes, 0, None)[0]


def plan_range(storage: Storage, path: str, name: str, rows: int | None, shard_bytes: int | None,
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


def read(storage: Storage, shard: Shard) -> list[Row]:
    """The rows of a shard, each with its id (file:line) and its parse error; blank lines are skipped."""
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


def first_row(f) -> dict:
    """The first non-blank line of an open JSON-lines file as a dict ({} when it is none)."""
    for raw in f:
        if raw.strip():
            try:
                value = json.loads(raw)
            except ValueError:
                return {}
            return value if isinstance(value, dict) else {}
    return {}


def columns(f) -> list[str]:
    """Column names of an open file's first row."""
    return list(first_row(f))


def first_value(f, column: str):
    """The first row's value of `column` in an open file (None where it has none)."""
    return first_row(f).get(column)


def encode(table: pa.Table) -> bytes:
    """An output part's bytes: one JSON object a line."""
    return "".join(json.dumps(row, ensure_ascii=False, default=str) + "\n"
                   for row in table.to_pylist()).encode("utf-8")


def decode(data: bytes) -> pa.Table:
    """An output part's table from its bytes (the inverse of `encode`)."""
    return pa.Table.from_pylist([json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()])


count = CommitRecord.counted
"""The counts over a part's rows."""


def finish(out, parts) -> None:
    """What a complete job adds for this format beyond its parts: nothing (the parts are the output)."""
    return None


def _short(exc: Exception) -> str:
    return str(exc).split("\n")[0][:120]
