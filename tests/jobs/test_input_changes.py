"""An output is resumed only on the input files it started with: a file that changed or went since
is refused in one line naming it (its committed parts cover its rows as they were: a file that grew
would be cut into new shards beside them, and data/ would hold those rows twice); files added since
are new shards, and the output gets each id once."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from chaos.harness import hook_env
from helpers import committed_ids, read_output, write_jsonl
from jobs.cli import main

pytestmark = [pytest.mark.usefixtures("ray_local"), pytest.mark.timeout(240)]


def run(*args):
    result = CliRunner().invoke(main, ["run", *map(str, args)], catch_exceptions=False)
    return result.exit_code, result.output


def test_a_resume_on_changed_input_files_is_refused_and_added_files_resume(tmp_path, monkeypatch):
    inp = tmp_path / "in"
    write_jsonl(inp / "a.jsonl", [{"prompt": f"a {i}"} for i in range(4)])
    write_jsonl(inp / "b.jsonl", [{"prompt": f"b {i}"} for i in range(4)])
    out = tmp_path / "out"
    flags = ["--model", "builtin:echo", "--input", inp, "--output", out, "--set", "workers.rows_per_batch=2",
             "--set", "workers.num=1", "--set", "sampling.max_tokens=2"]
    for key, value in hook_env(f"shard#2:raise:{tmp_path / 'fired'}").items():
        monkeypatch.setenv(key, value)
    code, text = run(*flags)
    assert code == 1, text  # half written
    assert json.loads((out / "_job.json").read_text())["inputs"]["files"] == 2

    original = (inp / "a.jsonl").read_bytes()
    (inp / "a.jsonl").write_bytes(original + b'{"prompt": "a 4"}\n')  # grown since
    code, text = run(*flags)
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1, text
    assert (f"input file a.jsonl changed since this output was started ({len(original):,} bytes then, "
            f"{len(original) + 18:,} now): write to a new output.path, or use --overwrite") in errors[0]
    (inp / "a.jsonl").unlink()
    code, text = run(*flags)
    assert code == 1 and "input file a.jsonl is gone since this output was started" in text, text

    (inp / "a.jsonl").write_bytes(original)  # put back, and a file added
    write_jsonl(inp / "c.jsonl", [{"prompt": f"c {i}"} for i in range(3)])
    code, text = run(*flags)
    assert code == 0, text
    want = sorted(f"{f}.jsonl:{i}" for f, n in (("a", 4), ("b", 4), ("c", 3)) for i in range(n))
    assert sorted(read_output(out)["id"].to_pylist()) == want and sorted(committed_ids(out)) == want
    assert json.loads((out / "_job.json").read_text())["inputs"]["files"] == 3
