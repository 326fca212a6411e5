"""`--model org/name`: a job runs offline from a Hugging Face cache; a missing id stops the job in
one line naming it, before any actor starts."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from engine.models.builtin import builtin_path
from helpers import read_output, write_jsonl
from jobs.cli import main

pytestmark = [pytest.mark.usefixtures("ray_local"), pytest.mark.timeout(300)]


def run(*args):
    result = CliRunner().invoke(main, ["run", *map(str, args)], catch_exceptions=False)
    return result.exit_code, result.output


def test_job_with_a_hub_id_completes_offline_from_the_cache(hub_model, tmp_path):
    hub_model("testorg/tiny-job", builtin_path("builtin:tiny"))
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"row {i}"} for i in range(6)])
    flags = ["--input", tmp_path / "in.jsonl", "--set", "sampling.max_tokens=5", "--set", "sampling.temperature=0"]
    code, text = run(*flags, "--model", "testorg/tiny-job", "--output", tmp_path / "hub")
    assert code == 0, text
    code, text = run(*flags, "--model", "builtin:tiny", "--output", tmp_path / "builtin")
    assert code == 0, text
    hub, builtin = read_output(tmp_path / "hub"), read_output(tmp_path / "builtin")
    assert hub.num_rows == 6 and set(hub["finish_reason"].to_pylist()) == {"length"}
    assert hub["generated_text"].to_pylist() == builtin["generated_text"].to_pylist()  # the same weights


def test_missing_hub_id_fails_in_one_line_naming_it(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    code, text = run("--input", tmp_path / "in.jsonl", "--output", tmp_path / "out", "--model", "nobody/missing-model")
    assert code == 1
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, text
    assert "nobody/missing-model" in errors[0] and "HF_HUB_OFFLINE is set" in errors[0]
    assert "shards planned" not in text and not (tmp_path / "out" / "data").exists()  # no actor started


def test_a_resume_whose_hub_revision_moved_is_refused_and_an_earlier_output_records_its_model(
        hub_model, tmp_path, monkeypatch):
    import json
    import shutil

    from chaos.harness import hook_env

    first = hub_model("testorg/moving", builtin_path("builtin:tiny"))
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"row {i}"} for i in range(6)])
    out = tmp_path / "out"
    flags = ["--input", tmp_path / "in.jsonl", "--output", out, "--model", "testorg/moving", "--set",
             "sampling.max_tokens=3", "--set", "workers.rows_per_batch=2", "--set", "workers.num=1"]
    for key, value in hook_env(f"shard#2:raise:{tmp_path / 'fired'}").items():
        monkeypatch.setenv(key, value)
    code, text = run(*flags)
    assert code == 1, text  # a crash after the first shard: the output is half written
    record = json.loads((out / "_job.json").read_text())
    assert record["model_identity"] == {"kind": "hub", "id": f"testorg/moving@{first}"}

    moved = tmp_path / "moved"
    shutil.copytree(builtin_path("builtin:tiny"), moved)
    (moved / "README.md").write_text("a new commit on main\n")
    second = hub_model("testorg/moving", moved)  # main moves under the half-written output
    code, text = run(*flags)
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1, text
    assert (f"the model testorg/moving changed since its rows were written (testorg/moving@{first} then, "
            f"testorg/moving@{second} now): write to a new output.path, or use --overwrite") in errors[0]

    hub_model("testorg/moving", builtin_path("builtin:tiny"))  # main moves back
    del record["model_identity"]  # as an output of a batchinfer before model identities were recorded
    (out / "_job.json").write_text(json.dumps(record))
    code, text = run(*flags)
    assert code == 0, text
    assert json.loads((out / "_job.json").read_text())["model_identity"]["id"] == f"testorg/moving@{first}"
    assert sorted(read_output(out)["id"].to_pylist()) == sorted(f"in.jsonl:{i}" for i in range(6))
