"""One owner of the output directory: OutputDir reads and changes every record under an output,
the job record is frozen, the manifest is a typed record, earlier versions' shapes are read in one
module (pipeline.io.earlier), and commit records cross Ray as CommitRecords, not JSON text."""
from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from pipeline.io import CommitRecord, JobRecord, Manifest, OutputDir, Shard, Storage, entries
from pipeline.io.earlier import ROWS_PLAN, read_job_record

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = [p for top in ("pipeline", "jobs") for p in (ROOT / top).rglob("*.py")]


def output(tmp_path, fmt: str = "parquet") -> OutputDir:
    return OutputDir(Storage(str(tmp_path / "out")), fmt)


def test_the_job_record_is_frozen_and_changes_only_through_its_owner(tmp_path):
    out = output(tmp_path)
    assert out.open_record() is None
    out.start_record(JobRecord(fingerprint="f", created=1.0, shard_plan="segments", segment_bytes=10))
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.record.plan_blocks = 3  # type: ignore[misc]
    path = tmp_path / "out" / "_job.json"
    before = path.stat().st_mtime_ns
    out.change_record(segment_bytes=10)  # changes nothing: nothing written
    assert path.stat().st_mtime_ns == before
    assert out.change_record(plan_blocks=3).plan_blocks == 3
    assert json.loads(path.read_text())["plan_blocks"] == 3
    again = output(tmp_path)
    assert again.open_record() == out.record and again.record.plan_blocks == 3


def test_an_earlier_record_is_read_into_todays_fields_once_and_written_back_as_it_was(tmp_path):
    """A record of batchinfer 0.1 (no shard_plan, no numerics) whose output has parts: read as shard
    plan "rows" and numerics {device} alone, its spec's; what a run changes is written, what was
    filled is not, until a run sets it."""
    out = output(tmp_path)
    out.write_json("_job.json", {"fingerprint": "f", "created": 1.0, "spec": {"workers": {"gpus": 0}}, "newer": 1})
    assert out.open_record().numerics is None  # no parts: nothing to know its numerics from
    out.storage.fs.makedirs(out.storage.path("data"), exist_ok=True)
    record = out.open_record()
    assert record.shard_plan == ROWS_PLAN and record.numerics == {"device": "cpu"}
    out.change_record(plan_blocks=2)
    written = out.read_json("_job.json")
    assert written == {"fingerprint": "f", "created": 1.0, "spec": {"workers": {"gpus": 0}}, "plan_blocks": 2,
                       "newer": 1}
    out.change_record(numerics={"device": "cpu", "dtype": "float32"})
    assert out.read_json("_job.json")["numerics"] == {"device": "cpu", "dtype": "float32"}
    assert "shard_plan" not in out.read_json("_job.json")
    assert read_job_record({"spec": {"workers": {"gpus": 1}}}, has_parts=True).numerics == {"device": "cuda"}


def test_the_manifest_is_a_typed_record_that_keeps_what_it_does_not_know(tmp_path):
    out = output(tmp_path)
    m = Manifest(rows=4, errors=1, status="complete", index={"dir": "_index/r", "files": [], "parts": 0,
                                                             "format": "jsonl"}, unknown={"newer": True})
    out.write_manifest(m)
    data = out.read_json("manifest.json")
    assert data["rows"] == 4 and data["newer"] is True and "parts" not in data and "metrics" not in data
    back = out.read_manifest()
    assert back == m and back.layout == 2 and back.error_rate == 0.25
    assert Manifest.from_dict(back.to_dict()) == back


def test_a_layout_1_manifest_lists_its_parts_itself(tmp_path):
    out = output(tmp_path)
    parts = [{"path": "p0", "rows": 2}, {"path": "p1", "rows": 3}]
    out.write_json("manifest.json", {"rows": 5, "status": "complete", "parts": parts})
    manifest = out.read_manifest()
    assert manifest.layout == 1 and manifest.index is None and list(entries(out, manifest)) == parts


def test_the_planner_hands_commit_records_to_the_actors_as_records(tmp_path):
    """A resumed output's planning task marks a committed shard done and carries its CommitRecord as
    a Python object (Ray Data's object column), with an empty record for a shard still to run."""
    pytest.importorskip("ray")
    import pyarrow as pa

    from pipeline.run.shards.planner import Unit, plan_block
    from pipeline.spec import validate

    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(4)))
    spec = validate({"model": "builtin:echo", "input": {"path": str(tmp_path / "in.jsonl")},
                     "output": {"path": str(tmp_path / "out")}, "workers": {"rows_per_batch": 2}})
    out = output(tmp_path)
    from pipeline.run.shards.planner import output_plan

    plan = output_plan(spec)
    unit = Unit(str(tmp_path / "in.jsonl"), "in.jsonl", "jsonl", None)
    batch = pa.table({f: [[getattr(unit, f)]] for f in Unit._fields if f != "size"})
    first = plan_block(batch, spec, resume=False, plan=plan)
    assert first.column("done").to_pylist() == [False, False]
    shard = Shard(**{k: first.column(k)[0].as_py() for k in first.column_names if k not in ("done", "committed")})
    table = pa.table({"id": ["in.jsonl:0"], "finish_reason": ["stop"], "error": [None], "num_prompt_tokens": [1],
                      "num_generated_tokens": [2]})
    out.commit(shard.key, table, dataclasses.replace(CommitRecord.counted(table), **out.identity(shard)))
    again = plan_block(batch, spec, resume=True, plan=plan)
    assert again.column("done").to_pylist() == [True, False]
    done, todo = again.column("committed").to_pylist()
    assert isinstance(done, CommitRecord) and done.shard == shard.key and done.generated_tokens == 2
    assert todo == CommitRecord()


def _calls(tree):
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)]


def test_only_the_owner_writes_the_job_record_and_the_manifest_and_reads_earlier_shapes():
    """Outside pipeline/io, no module writes `_job.json` or `manifest.json` itself, builds a JobRecord
    from storage (`JobRecord.from_dict`), or imports pipeline.io.earlier or EARLIER_SHAPES."""
    found = []
    for path in PRODUCT:
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("pipeline/io/"):
            continue
        tree = ast.parse(path.read_text())
        for call in _calls(tree):
            func = call.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            args = [a.value for a in call.args if isinstance(a, ast.Constant)]
            if name == "write_json" and any(a in ("_job.json", "manifest.json") for a in args):
                found.append(f"{rel}:{call.lineno} writes {args[0]}")
            if name == "from_dict" and isinstance(func, ast.Attribute) and getattr(func.value, "id", "") == "JobRecord":
                found.append(f"{rel}:{call.lineno} JobRecord.from_dict")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module == "pipeline.io.earlier" or any(
                    a.name == "EARLIER_SHAPES" for a in node.names)):
                found.append(f"{rel}:{node.lineno} imports earlier shapes")
    assert not found, found
