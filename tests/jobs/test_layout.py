"""The output layout: a small manifest pointing to a part index, and outputs of the earlier
layout (parts listed in manifest.json, shards cut every rows_per_batch rows) still readable and
resumable, or refused in one line."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from helpers import committed_ids, read_output, write_jsonl
from jobs.cli import main
from jobs.spec import load_spec
from pipeline.io import JobRecord, OutputDir, Storage, index

pytestmark = pytest.mark.usefixtures("ray_local")


def run(*args):
    result = CliRunner().invoke(main, ["run", *map(str, args)], catch_exceptions=False)
    return result.exit_code, result.output


def validated(*args) -> tuple[int, int]:
    """(rows, shards) as `batchinfer validate` counts them for the run's arguments."""
    result = CliRunner().invoke(main, ["validate", *map(str, args)])
    assert result.exit_code == 0, result.output
    rows, shards = re.search(r"(\d+) rows \(JSONL: lines\), (\d+) shards", result.output).groups()
    return int(rows), int(shards)


def test_the_manifest_points_to_an_index_in_several_files(tmp_path, monkeypatch):
    monkeypatch.setattr(index, "ENTRIES_PER_FILE", 4)
    for f in range(3):
        write_jsonl(tmp_path / "in" / f"{f}.jsonl", [{"prompt": f"{f} {i}"} for i in range(5)])
    out = tmp_path / "out"
    code, text = run("--model", "builtin:echo", "--input", tmp_path / "in", "--output", out, "--set", "workers.rows_per_batch=2",
                     "--set", "sampling.max_tokens=1")
    assert code == 0, text
    manifest = json.loads((out / "manifest.json").read_text())
    assert "parts" not in manifest and manifest["index"]["parts"] == 9 and len(manifest["index"]["files"]) == 3
    lines = [json.loads(x) for f in manifest["index"]["files"]
             for x in (out / manifest["index"]["dir"] / f).read_text().splitlines()]
    assert sorted((e["file"], e["start"], e["stop"]) for e in lines) == sorted(
        (f"{f}.jsonl", s, min(s + 2, 5)) for f in range(3) for s in range(0, 5, 2))
    assert sorted(read_output(out)["id"].to_pylist()) == sorted(f"{f}.jsonl:{i}" for f in range(3) for i in range(5))
    assert manifest["shards"]["count"] == 9 and manifest["shards"]["fixed_seconds_per_shard"] >= 0
    report = json.loads(CliRunner().invoke(main, ["report", str(out), "--json"]).output)
    assert report["rows"] == 15 and report["shards_committed"] == 9


def test_an_earlier_layout_resumes_with_its_row_count_shards(tmp_path):
    """An output started before shard_bytes (its _job.json has no shard_plan) keeps its shards of
    rows_per_batch rows, though these 150 KB rows would make shards of 7 rows by bytes."""
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"{i} " + "x" * 150_000} for i in range(10)])
    out = tmp_path / "out"
    settings = ["model=builtin:echo", "workers.rows_per_batch=4", "sampling.max_tokens=1", "max_error_rate=1"]
    spec = load_spec(None, settings, input=str(tmp_path / "in.jsonl"), output=str(out))
    out.mkdir()
    (out / "_job.json").write_text(json.dumps({"fingerprint": spec.fingerprint(), "created": 1.0,
                                               "spec": spec.model_dump(mode="json")}))
    args = ["--input", tmp_path / "in.jsonl", "--output", out, *[a for s in settings for a in ("--set", s)]]
    assert run(*args)[0] == 0
    parts = sorted((out / "data").iterdir())
    assert len(parts) == 3
    for name in ("manifest.json", "_SUCCESS"):
        (out / name).unlink()
    parts[0].unlink()
    code, text = run(*args)
    assert code == 0, text
    assert sorted(committed_ids(out)) == sorted(f"in.jsonl:{i}" for i in range(10))
    assert len(list((out / "data").iterdir())) == 3 and "[3 shards, 2 committed earlier]" in text


EARLIER = Path(__file__).resolve().parents[1] / "data" / "outputs"
"""Output directories written by earlier versions of main, each with its input (relative paths)."""


@pytest.mark.parametrize("name", sorted(p.name for p in EARLIER.iterdir() if p.is_dir()))
def test_an_output_an_earlier_main_left_half_done_resumes(name, tmp_path):
    """tests/data/outputs/<date>: a job of 8 rows in shards of 2, run whole by main of that date,
    then two shards' parts, their commit records, the manifest and _SUCCESS removed, as a crash
    leaves it (its README says how). Today's rerun of the same command, in that folder (its paths
    are relative, so in a process and a Ray of its own), reads its _job.json as a JobRecord,
    computes only those two shards and completes with every id once."""
    folder = tmp_path / name
    shutil.copytree(EARLIER / name, folder)
    for f in (folder / "output").rglob("*.json*"):  # the absolute output path it was written at
        f.write_text(f.read_text().replace("{root}", str(folder)))
    record = OutputDir(Storage(str(folder / "output")), "parquet").open_record()
    assert record is not None and record.fingerprint and record.shard_plan == "segments"
    assert record.batchinfer_version is None  # EARLIER_SHAPES: before it was recorded
    assert JobRecord.from_dict(record.to_dict()) == record
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-m", "jobs.run", "--model", "builtin:echo", "--input", "input.jsonl",
                           "--output", "output", "--set", "workers.rows_per_batch=2", "--set", "sampling.max_tokens=2"],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    manifest = json.loads((folder / "output" / "manifest.json").read_text())
    assert manifest["this_run"]["rows"] == 4 and manifest["rows"] == 8
    assert sorted(committed_ids(folder / "output")) == sorted(f"input.jsonl:{i}" for i in range(8))
    assert OutputDir(Storage(str(folder / "output")), "parquet").open_record().fingerprint == record.fingerprint

def test_an_earlier_layout_with_the_old_default_is_refused_in_one_line(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    out = tmp_path / "out"
    out.mkdir()
    (out / "_job.json").write_text(json.dumps({"fingerprint": "0123456789abcdef", "created": 1.0,
                                               "spec": {"output": {"format": "parquet"}}}))
    code, text = run("--model", "builtin:tiny", "--input", tmp_path / "in.jsonl", "--output", out)
    errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert code == 1 and len(errors) == 1 and "--set workers.rows_per_batch=256" in errors[0], text
    assert not (out / "data").exists()


def test_an_output_of_builtin_tiny_as_the_old_default_model_says_to_name_it(tmp_path):
    """builtin:tiny was the default model until builtin:smollm2-135m-instruct: rerunning its output
    with a spec that names no model is refused in one line saying to add `model: builtin:tiny`, not
    as "a different job spec"; naming it resumes."""
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    out = tmp_path / "out"
    settings = ["--set", "sampling.max_tokens=2", "--set", "workers.rows_per_batch=1"]
    assert run("--model", "builtin:tiny", "--input", tmp_path / "in.jsonl", "--output", out, *settings)[0] == 0
    record = json.loads((out / "_job.json").read_text())
    assert record["spec"]["model"] == "builtin:tiny"
    (out / "_SUCCESS").unlink()
    code, text = run("--input", tmp_path / "in.jsonl", "--output", out, *settings)
    errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert code == 1 and len(errors) == 1 and "add `model: builtin:tiny`" in errors[0], text
    assert "different job spec" not in text


def test_a_large_jsonl_file_is_planned_in_segments_by_parallel_tasks_and_resumes(tmp_path, monkeypatch):
    """A file of many segments: several planning tasks, one line sequencer, the ids and row
    order of a whole-file plan, and a resume that finds the same shards."""
    from pipeline.run.shards import planner

    monkeypatch.setattr(planner, "SEGMENT_BYTES", 300)
    rows = [{"prompt": f"{i} " + "y" * (i * 53 % 400)} for i in range(60)]  # some lines span segments
    write_jsonl(tmp_path / "in" / "big.jsonl", rows)
    write_jsonl(tmp_path / "in" / "small.jsonl", [{"prompt": "s"}])
    out = tmp_path / "out"
    args = ["--input", tmp_path / "in", "--output", out, "--set", "model=builtin:echo",
            "--set", "workers.shard_bytes=700", "--set", "sampling.max_tokens=1"]
    before = validated(*args)  # batchinfer validate plans as the run's tasks do: the same counts
    code, text = run(*args)
    assert code == 0, text
    assert before == (61, len(list((out / "data").iterdir())))
    job = json.loads((out / "_job.json").read_text())
    size = (tmp_path / "in" / "big.jsonl").stat().st_size
    segments = -(-size // 300)  # 8 to a planning task (FILES_PER_PLAN_TASK), as they are small
    assert job["shard_plan"] == "segments" and job["segment_bytes"] == 300
    assert job["plan_blocks"] == -(-(segments + 1) // 8)
    records = [json.loads(p.read_text()) for p in (out / "_plan").glob("*.json")]
    assert sum(r["segments"] for r in records) == segments and sum(r["files"] for r in records) == 2
    expected = sorted([f"big.jsonl:{i}" for i in range(60)] + ["small.jsonl:0"])
    table = read_output(out)
    assert sorted(table["id"].to_pylist()) == expected
    assert all(p.startswith(i.split(":")[1] + " ") for i, p in zip(table["id"].to_pylist(),
                                                                    table["prompt"].to_pylist()) if "big" in i)
    parts = sorted((out / "data").iterdir())
    for name in ("manifest.json", "_SUCCESS"):
        (out / name).unlink()
    for part in parts[1::2]:
        part.unlink()
    monkeypatch.setattr(planner, "SEGMENT_BYTES", 10_000)  # the output's own segment size wins
    assert validated(*args) == before  # validate reads the output's plan too
    code, text = run(*args)
    assert code == 0, text
    assert sorted(committed_ids(out)) == expected and len(list((out / "data").iterdir())) == len(parts)
    assert f"{len(parts) - len(parts[1::2])} committed earlier" in text


def test_an_output_planned_by_whole_files_resumes_so(tmp_path, monkeypatch):
    """An output started before segments ("shard_plan": "bytes") keeps whole-file shards on a
    resume, whatever the segment size now; a shard plan from a newer version is refused."""
    from pipeline.run.checks import claim
    from pipeline.run.shards import planner

    write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"{i} " + "z" * 300} for i in range(20)])
    out = tmp_path / "out"
    args = ["--input", tmp_path / "in.jsonl", "--output", out, "--set", "model=builtin:echo",
            "--set", "workers.shard_bytes=2000", "--set", "sampling.max_tokens=1"]
    monkeypatch.setattr(claim, "new_plan_record", lambda: {"shard_plan": "bytes"})
    assert run(*args)[0] == 0
    parts = sorted((out / "data").iterdir())
    for name in ("manifest.json", "_SUCCESS"):
        (out / name).unlink()
    parts[0].unlink()
    monkeypatch.setattr(planner, "SEGMENT_BYTES", 1000)
    code, text = run(*args)
    assert code == 0, text
    assert sorted(committed_ids(out)) == sorted(f"in.jsonl:{i}" for i in range(20))
    assert len(list((out / "data").iterdir())) == len(parts) and "segments" not in (out / "_job.json").read_text()
    job = json.loads((out / "_job.json").read_text())
    (out / "_job.json").write_text(json.dumps({**job, "shard_plan": "pages"}))
    (out / "_SUCCESS").unlink()
    code, text = run(*args)
    errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert code == 1 and len(errors) == 1 and "newer batchinfer" in errors[0], text
