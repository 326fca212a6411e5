"""The run lock: one writer per output; dead or silent owners are taken over."""
import json
import socket
import subprocess
import sys
import time

import pytest

from pipeline.io import LockHeld, RunLock, Storage


def plant(storage, **record):
    base = {"owner": "other:1:x", "host": socket.gethostname(), "pid": 1, "heartbeat": time.time()}
    storage.write_atomic(storage.path("_lock.json"), json.dumps(base | record).encode())


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_acquire_holds_and_release_removes(tmp_path):
    storage = Storage(str(tmp_path))
    with RunLock(storage, settle_s=0) as lock:
        assert json.loads((tmp_path / "_lock.json").read_text())["owner"] == lock.owner
        with pytest.raises(LockHeld, match="another run"):
            RunLock(storage, settle_s=0).acquire()
    assert not (tmp_path / "_lock.json").exists()


def test_lock_of_a_dead_process_on_this_host_is_taken_over(tmp_path):
    storage = Storage(str(tmp_path))
    plant(storage, pid=dead_pid())
    with RunLock(storage, settle_s=0) as lock:
        assert lock.took_over["owner"] == "other:1:x"


def test_lock_elsewhere_is_respected_until_its_heartbeat_is_stale(tmp_path):
    storage = Storage(str(tmp_path))
    plant(storage, host="elsewhere", heartbeat=time.time() - 30)
    with pytest.raises(LockHeld, match="heartbeat 30s ago"):
        RunLock(storage, stale_after_s=60, settle_s=0).acquire()
    plant(storage, host="elsewhere", heartbeat=time.time() - 90)
    with RunLock(storage, stale_after_s=60, settle_s=0) as lock:
        assert lock.took_over["host"] == "elsewhere"


def test_heartbeat_advances_and_calls_back(tmp_path):
    storage = Storage(str(tmp_path))
    beats = []
    with RunLock(storage, heartbeat_s=0.05, settle_s=0, on_heartbeat=lambda: beats.append(1)):
        first = json.loads((tmp_path / "_lock.json").read_text())["heartbeat"]
        time.sleep(0.4)
        later = json.loads((tmp_path / "_lock.json").read_text())["heartbeat"]
    assert later > first and len(beats) >= 2


def test_losing_a_simultaneous_acquire_is_reported(tmp_path, monkeypatch):
    storage = Storage(str(tmp_path))
    lock = RunLock(storage, settle_s=0)
    monkeypatch.setattr(lock, "_write", lambda: plant(storage, owner="rival:2:y"))
    with pytest.raises(LockHeld, match="rival"):
        lock.acquire()
