"""No abort at interpreter exit: reading a job's output with scripts/show_output.py (the README's
first command prints rows with it) or `batchinfer report` exits 0 every time, not 134 after it
printed its result. The abort came from Arrow's pool threads freeing a Python-owned buffer while
the interpreter exited (pipeline.io.output.arrow_owned), one run in a few."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa

from pipeline.io import CommitRecord, IndexWriter, OutputDir, Storage

ROOT = Path(__file__).resolve().parents[2]
RUNS = 10
PARTS = 12


def complete_output(out: Path) -> None:
    """A complete output of PARTS parts of 16 rows, as a job leaves it."""
    storage = Storage(str(out))
    output = OutputDir(storage, "parquet")
    index = IndexWriter(output, "run-1")
    for k in range(PARTS):
        rows = [{"id": f"{k}:{i}", "prompt": f"row {i}", "generated_text": "x" * i, "num_prompt_tokens": 3,
                 "num_generated_tokens": i, "finish_reason": "length", "error": None} for i in range(16)]
        key = f"shard{k}"
        record = CommitRecord(shard=key, path=output.part_path(key), file="in.jsonl", start=16 * k, stop=16 * (k + 1),
                              rows=16, generated_tokens=sum(range(16)))
        output.commit(key, pa.Table.from_pylist(rows), record)
        index.add(record)
    index.flush()
    output.write_json("_job.json", {"fingerprint": "f", "spec": {"output": {"format": "parquet"}}})
    output.write_json("manifest.json", {"format": "parquet", "rows": 16 * PARTS, "index": index.pointer()})
    output.mark_success()


def test_show_output_and_report_exit_0_in_every_run(tmp_path):
    out = tmp_path / "out"
    complete_output(out)
    commands = [[sys.executable, "scripts/show_output.py", str(out), "--rows", "1000"],
                [sys.executable, "-m", "jobs.cli", "report", str(out)]]

    def once(command):
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
        return done.returncode, done.stdout, done.stderr

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(once, [c for c in commands for _ in range(RUNS)]))
    codes = [code for code, _, _ in results]
    assert codes == [0] * (2 * RUNS), [(c, err[-300:]) for c, _, err in results if c]
    assert f"... {16 * PARTS} rows in {PARTS} parts" in results[0][1]
    assert re.search(rf"^shards committed +{PARTS} of {PARTS}$", results[-1][1], flags=re.M), results[-1][1]
    assert json.loads((out / "manifest.json").read_text())["rows"] == 16 * PARTS
