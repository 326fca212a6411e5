"""Shared helpers for job tests: input files and reading outputs back."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.index import part_entries


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read_output(out: Path) -> pa.Table:
    """Every committed row, read the way a user would: through the part index the manifest points to."""
    manifest = json.loads((out / "manifest.json").read_text())
    tables = []
    for part in part_entries(str(out)):
        if manifest["format"] == "parquet":
            tables.append(pq.read_table(part["path"]))
        else:
            rows = [json.loads(line) for line in Path(part["path"]).read_text().splitlines()]
            tables.append(pa.Table.from_pylist(rows))
    return pa.concat_tables(tables, promote_options="default")


def committed_ids(out: Path) -> list[str]:
    """Ids in every committed part (manifest or not): what a reader of data/ would find."""
    ids = []
    for part in sorted((out / "data").glob("part-*")):
        if part.suffix == ".parquet":
            ids += pq.read_table(part, columns=["id"])["id"].to_pylist()
        else:
            ids += [json.loads(line)["id"] for line in part.read_text().splitlines()]
    return ids
