"""One module per format (pipeline/io/formats/): each reader plans and reads, each writer encodes,
decodes, counts and finishes, with the same calls; OpenAI Batch's files live in its own module."""
from __future__ import annotations

import inspect
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.io import OutputDir, Storage, formats, read_shard

READER_CALLS = ("plan", "read", "columns", "first_value")
WRITER_CALLS = ("encode", "decode", "count", "finish")


def test_every_format_module_has_the_calls_of_its_side():
    for name, module in formats.READERS.items():
        missing = [c for c in READER_CALLS if not inspect.isfunction(getattr(module, c, None))]
        assert not missing and module.SUFFIXES, (name, missing)
    for name, module in formats.WRITERS.items():
        missing = [c for c in WRITER_CALLS if not callable(getattr(module, c, None))]
        assert not missing, (name, missing)
    assert formats.reader("openai_batch") is formats.jsonl  # request lines are JSONL; the task parses them


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_a_reader_plans_and_reads_every_row_once_with_its_id(tmp_path, fmt):
    rows = [{"prompt": f"p{i}", "n": i} for i in range(7)]
    path = tmp_path / f"in.{fmt}"
    if fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=3)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    storage, module = Storage(str(tmp_path)), formats.reader(fmt)
    shards = module.plan(storage, str(path), path.name, 3, None)
    assert [(s.start, s.stop) for s in shards] == [(0, 3), (3, 6), (6, 7)]
    got = [row for s in shards for row in read_shard(storage, s)]
    assert [r.values for r in got] == rows and [r.id for r in got] == [f"{path.name}:{i}" for i in range(7)]
    with open(path, "rb") as f:
        assert module.columns(f) == ["prompt", "n"]
    with open(path, "rb") as f:
        assert module.first_value(f, "prompt") == "p0"


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_a_writer_round_trips_a_part_and_counts_it(fmt):
    table = pa.table({"id": ["a", "b"], "finish_reason": ["stop", "error"], "error": [None, "bad"],
                      "num_prompt_tokens": [3, 4], "num_generated_tokens": [5, 0]})
    module = formats.writer(fmt)
    assert module.decode(module.encode(table)).to_pylist() == table.to_pylist()
    counted = module.count(table)
    assert (counted.rows, counted.errors, counted.prompt_tokens, counted.generated_tokens) == (2, 1, 7, 5)


def test_openai_batch_writes_its_lines_counts_them_and_finishes_with_its_two_files(tmp_path):
    ok = {"id": "batch_req_1", "custom_id": "a", "error": None,
          "response": {"status_code": 200, "body": {"usage": {"prompt_tokens": 3, "completion_tokens": 2}}}}
    bad = {"id": "batch_req_2", "custom_id": "b", "response": None,
           "error": {"code": "invalid_request", "message": "no model"}}
    table = pa.table({"line": [json.dumps(ok), json.dumps(bad)]})
    module = formats.openai_batch
    assert module.decode(module.encode(table)).equals(table)
    counted = module.count(table)
    assert (counted.rows, counted.errors, counted.prompt_tokens, counted.generated_tokens) == (2, 1, 3, 2)
    out = OutputDir(Storage(str(tmp_path / "out")), "openai_batch")
    out.commit("k1", table, counted)
    said = out.finish([{"shard": "k1", "file": "in.jsonl", "start": 0}])
    assert said["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    assert (tmp_path / "out" / "output.jsonl").read_text().splitlines() == table.column("line").to_pylist()
    assert [json.loads(x)["custom_id"] for x in (tmp_path / "out" / "errors.jsonl").read_text().splitlines()] == ["b"]
    assert OutputDir(Storage(str(tmp_path / "p")), "parquet").finish([]) is None
