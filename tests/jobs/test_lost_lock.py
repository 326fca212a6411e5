"""A run that loses its lock stops: a storage outage keeps its heartbeat from being written for
longer than the lock stays fresh (output.lock_stale_after_s, shortened here), another run takes the
output over, and the first, mid-shard, commits nothing more and fails in one line. The second run
then finishes the output, every id once."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from chaos.harness import hook_env
from helpers import committed_ids, read_output, write_jsonl
from pipeline.errors import LockLost
from pipeline.io import RunLock
from pipeline.run import run_job
from pipeline.spec import Job, validate

pytestmark = [pytest.mark.usefixtures("ray_local"), pytest.mark.timeout(240)]


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_run_that_loses_its_lock_stops_and_the_output_keeps_every_id_once(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"row {i}"} for i in range(6)])
    out = tmp_path / "out"
    spec = validate({"model": "builtin:echo", "input": {"path": str(tmp_path / "in.jsonl")},
                     "output": {"path": str(out), "lock_stale_after_s": 1.0},
                     "workers": {"num": 1, "rows_per_batch": 2}, "sampling": {"max_tokens": 4}})
    # the actor's second shard takes 4 s before it commits: the outage and the takeover happen meanwhile
    for key, value in hook_env("shard#2:sleep=4").items():
        monkeypatch.setenv(key, value)
    write = RunLock._write
    outage = threading.Event()

    def unreachable(self):
        if outage.is_set():
            raise OSError("storage unreachable")
        write(self)

    monkeypatch.setattr(RunLock, "_write", unreachable)

    def storage_goes_down_and_another_run_takes_over():
        while not list((out / "data").glob("part-*")):  # the first shard is committed
            time.sleep(0.05)
        outage.set()
        time.sleep(1.5)  # past lock_stale_after_s: the run's heartbeat is stale
        # the other run's record, as its acquire writes it (its process has ended since: stale to the rerun)
        record = {"owner": "rival:1:x", "host": socket.gethostname(), "pid": dead_pid(), "heartbeat": time.time()}
        (out / "_lock.json").write_text(json.dumps(record))
        outage.clear()

    taker = threading.Thread(target=storage_goes_down_and_another_run_takes_over, daemon=True)
    taker.start()
    with pytest.raises(LockLost) as stopped:
        run_job(Job.of(spec), progress=lambda msg: None)
    taker.join(timeout=10)
    message = str(stopped.value)
    assert "\n" not in message and message.endswith("rerun to resume once the other run has ended"), message
    assert "could not write its heartbeat" in message or "another run (rival:1:x) took over" in message, message
    assert committed_ids(out) == ["in.jsonl:0", "in.jsonl:1"]  # the shard mid-way when the lock went was not committed
    assert not (out / "_SUCCESS").exists()
    assert json.loads((out / "_lock.json").read_text())["owner"] == "rival:1:x"  # never overwritten

    monkeypatch.delenv("BATCHINFER_CHAOS")
    result = run_job(Job.of(spec), progress=lambda msg: None)
    assert result.status == "complete"
    assert Counter(read_output(out)["id"].to_pylist()) == Counter(f"in.jsonl:{i}" for i in range(6))
    assert sorted(committed_ids(out)) == sorted(f"in.jsonl:{i}" for i in range(6))
    assert (out / "_SUCCESS").exists() and not (out / "_lock.json").exists()
