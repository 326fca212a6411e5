"""A job on a terminal draws one live bar (rows, tokens/s, ETA); off a terminal it prints plain
lines; Ray Data's own bars never draw."""
from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from helpers import write_jsonl
from jobs.cli import main

pytestmark = pytest.mark.usefixtures("ray_local")


class _Terminal:
    """The runner's stderr, claiming to be a terminal."""

    def __init__(self, stream):
        self.stream = stream

    def isatty(self):
        return True

    def __getattr__(self, name):
        return getattr(self.stream, name)


def run(tmp_path, name):
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"row {i}"} for i in range(12)])
    result = CliRunner().invoke(main, ["run", "--model", "builtin:echo", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / name),
                                       "--set", "workers.rows_per_batch=4", "--set", "sampling.max_tokens=3"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def test_terminal_gets_a_bar_and_logs_get_plain_lines(tmp_path, monkeypatch):
    plain = run(tmp_path, "plain").stderr
    assert "[3 shards] 12 rows, 0 errors" in plain and "generating:" not in plain
    assert "[1 shards] 4 rows" in plain and "% of input, ETA " in plain  # ETA from the listing's bytes
    assert plain.count(", 100% of input, ETA 0s") == 1

    real = click.get_text_stream
    monkeypatch.setattr(click, "get_text_stream", lambda name, *a, **k: _Terminal(real(name, *a, **k)))
    result = run(tmp_path, "tty")
    bar = result.stderr.replace("\r", "\n")
    # the plan streams in while shards run: the bar counts the input's bytes, from its listing
    assert "generating: 100%" in bar and "ETA 0s, 12 rows" in bar and "tok/s, 0 errors, 3 shards" in bar
    assert "[1 shards]" not in bar  # the bar replaces the per-shard lines
    assert "1 input files, planned by 1 Ray tasks" in bar  # messages still print above it
    for text in (plain, result.stderr):
        assert "MapBatches" not in text and "Running Dataset" not in text  # no Ray Data bars
    assert "rows" in result.stdout and "12 (12 this run)" in result.stdout  # the summary stays
