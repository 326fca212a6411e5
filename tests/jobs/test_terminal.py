"""A quiet terminal: a command prints batchinfer's own lines; what Ray and the libraries print goes
to a log file, kept when the command fails; --verbose shows everything. (A failed shard's cause
under `ray job submit`: tests/jobs/test_ray_submit.py.)"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from helpers import write_jsonl
from jobs.terminal import QuietTerminal, terminal

ROOT = Path(__file__).resolve().parents[2]
OURS = [r"\d+ input files, planned by \d+ Ray tasks.*", r"checking that id_column values are unique, beside the work",
        r"the shards are done; waiting for the unique-id check", r"devices: .*",
        r"\[\d+(/\d+)? shards.*\] \d+ rows, \d+ errors, \d+ tokens, .*",
        r"(output|rows|errors|prompt tokens|prefix cache hits|generated tokens|wall time|tokens/s)  +.*"]
"""Every line a plain `batchinfer run` may print when it succeeds."""


def test_low_level_writes_and_other_packages_warnings_go_to_the_log_file(tmp_path, capfd):
    with warnings.catch_warnings(), QuietTerminal() as quiet:
        warnings.simplefilter("always")
        os.write(2, b"core_worker.cc:2465: a C++ line\n")
        print("a library's line", file=sys.stderr)
        warnings.warn_explicit("a dependency's warning", UserWarning, "/site-packages/dep.py", 1)
        warnings.warn_explicit("our own warning", UserWarning, str(ROOT / "engine" / "config.py"), 1)
        print("error: ours", file=terminal())
        sys.stderr.flush()
        logged = Path(quiet.path).read_text()
    err = capfd.readouterr().err
    assert "error: ours" in err.splitlines() and "UserWarning: our own warning" in err, err
    assert "a dependency's warning" not in err and "core_worker" not in err and "a library's line" not in err, err
    assert "core_worker.cc" in logged and "a library's line" in logged and "a dependency's warning" in logged
    assert not Path(quiet.path).exists(), "a command that succeeded leaves no log file behind"


def test_a_failed_command_keeps_its_log_and_verbose_leaves_everything_as_it_was(tmp_path, capfd):
    with QuietTerminal() as quiet:
        os.write(2, b"ray says something\n")
        quiet.keep = quiet.logged()
    assert "ray says something" in Path(quiet.path).read_text()
    Path(quiet.path).unlink()
    with QuietTerminal(verbose=True) as loud:
        os.write(2, b"ray says something\n")
    assert loud.path is None and "ray says something" in capfd.readouterr().err


def test_a_plain_run_off_a_terminal_prints_only_its_own_lines(tmp_path):
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"id": f"a{i}", "prompt": f"row {i}"} for i in range(8)])
    write_jsonl(tmp_path / "in" / "b.jsonl", [{"id": f"b{i}", "prompt": f"row {i}"} for i in range(8)])
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"TOKENIZERS_PARALLELISM": "false"}
    args = [sys.executable, "-m", "jobs.run", "--model", "builtin:tiny", "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"),
            "--set", "model=builtin:echo", "--set", "workers.num=2", "--set", "workers.rows_per_batch=4",
            "--set", "input.id_column=id"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [ln for ln in (done.stdout + done.stderr).splitlines() if ln.strip()]
    strays = [ln for ln in lines if not any(re.fullmatch(p, ln) for p in OURS)]
    assert not strays, strays
    assert any(ln.startswith("[4 shards]") for ln in lines), lines


@pytest.mark.parametrize("command", ["run", "validate", "tune"])
def test_verbose_is_a_flag_of_run_validate_and_tune(command):
    from click.testing import CliRunner

    from jobs.cli import main

    out = CliRunner().invoke(main, [command, "--help"])
    assert out.exit_code == 0 and "--verbose" in out.output
