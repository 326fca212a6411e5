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
