"""Fault scenarios against real jobs (see jobs/chaos.py): after each, every input id is in the
committed output exactly once, and the job completed (in one run, or after a rerun)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.chaos import scenarios

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


# "driver SIGKILL mid-generation" is tests/jobs/test_resume.py (with a partial report); the rest here.
@pytest.mark.parametrize("name", [n for n in scenarios(Path("/unused")) if n != "driver SIGKILL mid-generation"])
def test_scenario_loses_and_duplicates_nothing(name, tmp_path):
    # Each scenario runs in its own process: some start their own Ray cluster.
    done = subprocess.run([sys.executable, "-m", "jobs.chaos", name, "--report", str(tmp_path / "report.json"),
                           "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert (tmp_path / "report.json").exists(), done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())[0]
    assert report["duplicates"] == 0 and report["lost"] == 0, report
    assert report["rows_out"] == report["rows_in"] == 160, report
    assert report["ok"] and done.returncode == 0, report
    if name == "actor constructor fails":
        assert "first run exit 1" in report["outcome"]
        log = (tmp_path / "f" / "job.log").read_text()
        assert "error: worker setup failed" in log and "injected fault at init" in log
    if name == "actor os._exit mid-shard, once":
        assert report["outcome"].startswith("first run exit 0"), "a crashed actor is replaced within the run"
    if name == "object storage throttling":
        assert "requests throttled" in report["outcome"] and "first run exit 0" in report["outcome"]
