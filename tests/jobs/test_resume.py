"""Exactly once across a crash: SIGKILL the driver (and everything it started) mid-job, rerun,
and find every input id exactly once, with the rerun doing only the remaining work."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import committed_ids, read_output, write_jsonl

pytestmark = pytest.mark.slow


def job_cmd(inp: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "jobs.run", "--input", str(inp), "--output", str(out),
            "--set", "workers.rows_per_batch=8", "--set", "sampling.max_tokens=48",
            "--set", "sampling.ignore_eos=true", "--set", "workers.num=1"]


def start(cmd, log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                            cwd=Path(__file__).resolve().parents[2])


def settle(out: Path, quiet_s: float = 3.0) -> None:
    """Waits until no part has been committed for `quiet_s`: Ray's actors run in their own process
    groups, so an orphaned actor may finish the shards already queued to it before it exits."""
    seen, since = -1, time.time()
    while time.time() - since < quiet_s:
        count = len(list((out / "data").glob("part-*")))
        if count != seen:
            seen, since = count, time.time()
        time.sleep(0.2)


def test_driver_sigkill_mid_generation_then_rerun(tmp_path):
    rows = 320
    for f in range(2):
        write_jsonl(tmp_path / "in" / f"{f}.jsonl",
                    [{"prompt": f"crash test {f}-{i} " + "w" * (i % 40)} for i in range(rows // 2)])
    out = tmp_path / "out"
    proc = start(job_cmd(tmp_path / "in", out), tmp_path / "run1.log")
    deadline = time.time() + 240
    while time.time() < deadline:
        parts = list((out / "data").glob("part-*")) if (out / "data").exists() else []
        if len(parts) >= 6 or proc.poll() is not None:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the job finished before it could be killed:\n" + (tmp_path / "run1.log").read_text()
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and the local Ray it started: a crashed machine
    proc.wait()
    settle(out)
    killed_at = committed_ids(out)
    assert 0 < len(killed_at) < rows and len(killed_at) == len(set(killed_at))
    assert not (out / "_SUCCESS").exists()
    partial = subprocess.run([sys.executable, "-m", "jobs.cli", "report", str(out), "--json"],
                             capture_output=True, text=True, check=True)
    report = json.loads(partial.stdout)
    assert report["status"] == "incomplete" and report["rows"] == len(killed_at)
    assert report["shards_committed"] == len(killed_at) // 8 and report["shards_planned"] == rows // 8

    proc = start(job_cmd(tmp_path / "in", out), tmp_path / "run2.log")
    assert proc.wait(timeout=600) == 0, (tmp_path / "run2.log").read_text()
    ids = committed_ids(out)
    expected = sorted(f"{f}.jsonl:{i}" for f in range(2) for i in range(rows // 2))
    assert sorted(ids) == expected, "every input id exactly once"
    assert sorted(read_output(out)["id"].to_pylist()) == expected
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["rows"] == rows
    assert manifest["this_run"]["rows"] <= rows - len(killed_at), "the rerun redid committed work"
    assert (out / "_SUCCESS").exists()
    assert not [p for p in (out / "data").iterdir() if p.name.startswith(".tmp-")]
