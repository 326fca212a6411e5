"""The output layout: a small manifest pointing to a part index, and outputs of the earlier
layout (parts listed in manifest.json, shards cut every rows_per_batch rows) still readable and
resumable, or refused in one line."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from helpers import committed_ids, read_output, write_jsonl
from jobs.cli import main
from jobs.spec import load_spec
from pipeline import index

pytestmark = pytest.mark.usefixtures("ray_local")


def run(*args):
    result = CliRunner().invoke(main, ["run", *map(str, args)], catch_exceptions=False)
    return result.exit_code, result.output


def test_the_manifest_points_to_an_index_in_several_files(tmp_path, monkeypatch):
    monkeypatch.setattr(index, "ENTRIES_PER_FILE", 4)
    for f in range(3):
        write_jsonl(tmp_path / "in" / f"{f}.jsonl", [{"prompt": f"{f} {i}"} for i in range(5)])
    out = tmp_path / "out"
    code, text = run("--input", tmp_path / "in", "--output", out, "--set", "workers.rows_per_batch=2",
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


def test_an_earlier_layout_with_the_old_default_is_refused_in_one_line(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    out = tmp_path / "out"
    out.mkdir()
    (out / "_job.json").write_text(json.dumps({"fingerprint": "0123456789abcdef", "created": 1.0,
                                               "spec": {"output": {"format": "parquet"}}}))
    code, text = run("--input", tmp_path / "in.jsonl", "--output", out)
    errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert code == 1 and len(errors) == 1 and "--set workers.rows_per_batch=256" in errors[0], text
    assert not (out / "data").exists()
