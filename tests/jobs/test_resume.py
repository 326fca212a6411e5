"""Exactly once across a crash: SIGKILL (or interrupt) the driver mid-job, rerun, and find every
input id exactly once, with the rerun doing only the remaining work."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from chaos.harness import descendants, hook_env
from helpers import committed_ids, read_output, write_jsonl
from jobs.cli import main

pytestmark = pytest.mark.slow


def job_cmd(inp: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "jobs.run", "--model", "builtin:tiny", "--input", str(inp), "--output", str(out),
            "--set", "workers.rows_per_batch=8", "--set", "sampling.max_tokens=48",
            "--set", "sampling.ignore_eos=true", "--set", "workers.num=1"]


def start(cmd, log: Path, env: dict | None = None) -> subprocess.Popen:
    """The command in its own session, with Ctrl-C's default disposition: a suite started in the
    background of a non-interactive shell inherits SIGINT ignored, and Python then installs no
    KeyboardInterrupt handler, so an interrupt test would see a driver that never stops."""
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                            cwd=Path(__file__).resolve().parents[2], env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


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
    rows = 160  # 20 shards: killed after 6, so the rerun has 14 or fewer left
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
    below = descendants(proc.pid)  # its Ray's raylet and actors (these run in process groups of their own)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and the local Ray it started: a crashed machine
    for pid in below:  # an orphaned actor would otherwise go on committing the shards queued to it
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
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


def batch_requests(n: int) -> list[dict]:
    """OpenAI Batch request lines: chat and completions (greedy and seeded), and invalid ones."""
    lines = []
    for i in range(n):
        if i % 7 == 3:
            body, url = {"prompt": f"bad {i}", "n": 0}, "/v1/completions"  # an error line
        elif i % 2:
            body, url = {"model": "m", "prompt": f"Once upon {i}", "temperature": 0.8, "seed": i}, "/v1/completions"
        else:
            body, url = {"model": "m", "messages": [{"role": "user", "content": f"Hello {i}?"}]}, "/v1/chat/completions"
        lines.append({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body})
    return lines


def batch_output(out: Path) -> tuple[list[dict], list[dict]]:
    read = lambda name: [json.loads(x) for x in (out / name).read_text().splitlines()]  # noqa: E731
    return read("output.jsonl"), read("errors.jsonl")


def without_created(lines: list[dict]) -> list[dict]:
    return [{**x, "response": {**x["response"], "body": {**x["response"]["body"], "created": None}}}
            if x["response"] else x for x in lines]


@pytest.mark.usefixtures("ray_local")
def test_openai_batch_output_and_usage_after_an_interrupted_run_and_resume(tmp_path):
    """The driver is interrupted (SIGINT) with some shards committed; the rerun completes the
    job. Its output.jsonl and errors.jsonl are what an uninterrupted run writes (every request
    once, in input order, all lines with the job's one creation time), and its usage counts
    both runs, the interrupted one's generation time included."""
    n, per_shard = 24, 2
    write_jsonl(tmp_path / "requests.jsonl", batch_requests(n))
    options = ["--set", "input.format=openai_batch", "--set", "output.format=openai_batch",
               "--set", "max_error_rate=1", "--set", f"workers.rows_per_batch={per_shard}",
               "--set", "sampling.max_tokens=4"]
    out = tmp_path / "out"
    args = ["--model", "builtin:tiny", "--input", str(tmp_path / "requests.jsonl"), "--output", str(out), *options]
    # The first run starts its own Ray (a run that fails inside the session's Ray can leave its
    # actor alive there); each shard waits 0.3 s before its commit, so the interrupt lands mid-job.
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | hook_env("shard:sleep=0.3")
    started = time.time()
    proc = start([sys.executable, "-m", "jobs.run", *args], tmp_path / "run1.log", env)
    while proc.poll() is None and time.time() < started + 180 and len(list(out.glob("data/part-*"))) < 2:
        time.sleep(0.05)
    assert proc.poll() is None, "the job ended before it could be interrupted:\n" + (tmp_path / "run1.log").read_text()
    # Ctrl-C, again if shards still commit 2 s after it (seen once, on a loaded machine, with
    # the job then running to its end: cause not found; a user would press it again too).
    for _ in range(3):
        parts = len(list(out.glob("data/part-*")))
        os.kill(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=2)
            break
        except subprocess.TimeoutExpired:
            if len(list(out.glob("data/part-*"))) <= parts:
                break  # generation stopped: the driver is shutting down; let it finish that
    assert proc.wait(timeout=60) != 0, (tmp_path / "run1.log").read_text()
    first_wall = time.time() - started
    settle(out)
    committed = len(list(out.glob("data/part-*")))
    assert 0 < committed < n // per_shard and not (out / "output.jsonl").exists()

    result = CliRunner().invoke(main, ["run", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["this_run"]["rows"] == n - committed * per_shard, "the rerun redid committed shards"
    lines, errors = batch_output(out)
    assert [x["custom_id"] for x in lines] == [f"req-{i}" for i in range(n)]
    assert errors == [x for x in lines if x["error"] is not None] and len(errors) == len(range(3, n, 7))
    assert len({x["response"]["body"]["created"] for x in lines if x["response"]}) == 1

    # usage: summed over the run records (one per run, under _runs/); a run's generation time is
    # from its start of generation to its end, whether it completed or was interrupted
    usage, this_run = manifest["usage"], manifest["this_run"]
    runs = sorted((json.loads(p.read_text()) for p in (out / "_runs").glob("*.json")), key=lambda r: r["started"])
    assert usage["runs"] == len(runs) == 2 and [r["status"] for r in runs] == ["failed", "done"]
    first, done = runs
    assert done["run_id"] == this_run["run_id"] and done["generate_seconds"] == this_run["generate_seconds"]
    assert first["generate_seconds"] == pytest.approx(first["finished"] - first["generate_started"], abs=0.1)
    assert 0 < first["generate_seconds"] < first["finished"] - first["started"] < first_wall
    assert usage["generate_seconds"] == pytest.approx(first["generate_seconds"] + this_run["generate_seconds"])
    assert usage["wall_seconds"] == pytest.approx(first["finished"] - first["started"] + this_run["wall_seconds"])
    assert usage["tokens_per_second"] == pytest.approx(manifest["generated_tokens"] / usage["generate_seconds"])

    reference = tmp_path / "uninterrupted"
    result = CliRunner().invoke(main, ["run", *args[:4], "--output", str(reference), *options],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    ref_lines, ref_errors = batch_output(reference)
    assert without_created(lines) == without_created(ref_lines)
    assert errors == ref_errors
    assert manifest["openai_batch"] == json.loads((reference / "manifest.json").read_text())["openai_batch"]
