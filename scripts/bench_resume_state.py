#!/usr/bin/env python
"""What resume state costs: Ray Data's checkpoint filter vs. batchinfer's shard records.

Ray Data's checkpointing (ray.data.checkpoint) loads every committed id into one sorted NumPy
array (built in one task, then handed to each filter actor). This measures that conversion for
N derived ids ("<file>:<row>") in this process, and the size of batchinfer's equivalent: one
part name per shard. Extrapolates both linearly to 10^8 and 10^9 rows.

    .venv/bin/python scripts/bench_resume_state.py [--ids 10000000] [--rows-per-shard 256]
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import pyarrow as pa
from ray.data._internal.arrow_ops import transform_pyarrow


def numpy_mb(array: np.ndarray) -> float:
    """Array memory, counting the Python str objects an object-dtype array points to."""
    total = array.nbytes
    if array.dtype == object and len(array):
        sample = array[:: max(1, len(array) // 10_000)]
        total += sum(sys.getsizeof(x) for x in sample) * len(array) / len(sample)
    return total / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ids", type=int, default=10_000_000)
    ap.add_argument("--rows-per-shard", type=int, default=256)
    ap.add_argument("--rows-per-file", type=int, default=1_000_000)
    args = ap.parse_args()
    n = args.ids
    files = np.arange(n) // args.rows_per_file
    rows = np.arange(n) % args.rows_per_file
    ids = pa.array([f"prompts/part-{f:05d}.jsonl:{r}" for f, r in zip(files.tolist(), rows.tolist())])
    table = pa.table({"id": ids})
    arrow_mb = table.nbytes / 2**20
    t0 = time.perf_counter()
    # What ray.data.checkpoint's convert_and_sort_checkpointed_ids does with the loaded ids.
    sorted_ids = np.sort(transform_pyarrow.to_numpy(table["id"], zero_copy_only=False))
    secs = time.perf_counter() - t0
    id_array_mb = numpy_mb(sorted_ids)
    shards = -(-n // args.rows_per_shard)
    shard_mb = shards * len("part-0123456789abcdef0123.parquet") / 2**20

    print(f"ids: {n:,} like {ids[0].as_py()!r} (numpy dtype {sorted_ids.dtype})")
    print("\n| resume state | for these ids | per 10^8 rows | per 10^9 rows |\n|---|---:|---:|---:|")
    for name, mb in [("ids as Arrow strings (checkpoint files)", arrow_mb),
                     ("Ray checkpoint filter: sorted NumPy id array (+ its str objects)", id_array_mb),
                     (f"batchinfer: one part name per shard ({args.rows_per_shard} rows)", shard_mb)]:
        scale = 1e8 / n
        print(f"| {name} | {mb:,.1f} MiB | {mb * scale / 1024:,.2f} GiB | {mb * scale * 10 / 1024:,.1f} GiB |")
    print(f"\nconvert + sort took {secs:.1f}s for {n:,} ids (~{secs * 1e8 / n / 60:.0f} min per 10^8, one task)")


if __name__ == "__main__":
    main()
