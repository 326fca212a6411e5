"""Parquet. Input: planned from the footer alone (rows, and bytes of uncompressed data), read by row
range through the row groups that hold it. Output: one zstd-compressed file a part."""
from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.io.records import CommitRecord
from pipeline.io.shard import Shard
from pipeline.io.storage import Storage
from pipeline.spec import Row

SUFFIXES = (".parquet", ".pq")


def plan(storage: Storage, path: str, name: str, rows: int | None, shard_bytes: int | None) -> list[Shard]:
    """The shards of a Parquet file: `rows` rows each, fewer where `shard_bytes` of its uncompressed
    data come first."""
    with storage.fs.open(path, "rb") as f:
        meta = pq.ParquetFile(f).metadata
        size = getattr(f, "size", None) or storage.fs.size(path)
    total = meta.num_rows
    if shard_bytes:
        data = sum(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups))
        by_bytes = max(1, shard_bytes * total // max(data, 1))
        rows = min(rows, by_bytes) if rows else by_bytes
    return [Shard(path, name, "parquet", start, min(start + rows, total), size * start // total,
                  size * min(start + rows, total) // total) for start in range(0, total, rows)]


def read(storage: Storage, shard: Shard) -> list[Row]:
    """The rows of a shard, each with its id (file:row)."""
    try:
        with storage.fs.open(shard.file, "rb") as f:
            table = _row_range(pq.ParquetFile(f), shard.start, shard.stop)
    except pa.ArrowException as exc:  # a short or corrupt read: an OSError, so it is retried
        raise OSError(f"cannot read rows {shard.start}-{shard.stop} of {shard.name}: {exc}") from exc
    if table.num_rows != shard.stop - shard.start:
        raise OSError(f"short read of {shard.name}: {table.num_rows} of {shard.stop - shard.start} rows")
    return [Row(f"{shard.name}:{shard.start + i}", values) for i, values in enumerate(table.to_pylist())]


def _row_range(pf: pq.ParquetFile, start: int, stop: int) -> pa.Table:
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
    # reference to it after the interpreter began to exit would abort the process (see arrow_owned).
    table = pf.read_row_groups(groups, use_threads=False)
    return table.slice(start - first_row, stop - start)


def columns(f) -> list[str]:
    """Column names of an open file."""
    return pq.ParquetFile(f).schema_arrow.names


def first_value(f, column: str):
    """The first row's value of `column` in an open file (None where it has no rows)."""
    values = pq.ParquetFile(f).read_row_group(0, columns=[column]).column(0)
    return values[0].as_py() if len(values) else None


def encode(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def decode(data: bytes) -> pa.Table:
    """An output part's table from its bytes (the inverse of `encode`)."""
    return pq.ParquetFile(pa.BufferReader(arrow_owned(data))).read()


count = CommitRecord.counted
"""The counts over a part's rows."""


def finish(out, parts) -> None:
    """What a complete job adds for this format beyond its parts: nothing (the parts are the output)."""
    return None


def arrow_owned(data: bytes) -> pa.Buffer:
    """`data` copied into memory that Arrow owns. Arrow's thread pools may drop the last reference
    to a buffer after the call that used it returned; when that buffer wraps a Python object, the
    pool thread takes the GIL to free it, and if the interpreter is exiting by then, the thread is
    ended inside a C++ destructor and the process aborts ("terminate called without an active
    exception", exit code 134). A buffer of Arrow's own needs no GIL to be freed."""
    buf = pa.allocate_buffer(len(data))
    memoryview(buf).cast("B")[:] = data
    return buf
