"""The run lock: one writer per output; dead or silent owners are taken over."""
import json
import socket
import subprocess
import sys
import time

import pytest

from pipeline.errors import LockLost
from pipeline.io import LockHeld, RunLock, Storage, owned_by


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


RACER = """
import json, sys, time
from pipeline.errors import LockLost
from pipeline.io import LockHeld, RunLock, Storage, owned_by
root, start = sys.argv[1], float(sys.argv[2])
lock = RunLock(Storage(root), settle_s=0.5)
read, reads = lock.read, []

def slow_read():  # a slow look before writing: the racers' looks overlap, and only an OS lock orders them
    record = read()
    if not reads:
        time.sleep(0.4)
    reads.append(record)
    return record

lock.read = slow_read
time.sleep(max(0.0, start - time.time()))
try:
    began = time.time()
    lock.acquire()
    print(json.dumps({"won": True, "waited": time.time() - began}))
    time.sleep(1.5)  # still holding when the others check
    lock.release()
except LockHeld as exc:
    print(json.dumps({"won": False, "why": str(exc)}))
"""


def test_racing_runs_on_a_local_disk_one_wins_without_waiting(tmp_path):
    """Four processes acquire one output's lock 0.1 s apart, each looking for 0.4 s before it
    writes (so each looks before the one before it has written): on a local disk the directory's
    OS lock lets exactly one hold it, and none waits for a settle."""
    start = time.time() + 3.0
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(tmp_path), str(start + 0.1 * k)],
                               stdout=subprocess.PIPE, text=True) for k in range(4)]
    results = [json.loads(p.communicate(timeout=60)[0]) for p in racers]
    winners = [r for r in results if r["won"]]
    assert len(winners) == 1, results
    assert all("another run" in r["why"] for r in results if not r["won"]), results
    assert winners[0]["waited"] < 0.4 + 0.5, "a local disk's lock waited for the settle"


def test_a_mounted_filesystem_still_settles(tmp_path, monkeypatch):
    import pipeline.io.lock as lock_module

    slept = []
    monkeypatch.setattr(lock_module, "filesystem_type", lambda path: "nfs4")
    monkeypatch.setattr(lock_module.time, "sleep", slept.append)
    with RunLock(Storage(str(tmp_path)), settle_s=0.25):
        pass
    assert slept == [0.25]
    monkeypatch.setattr(lock_module, "filesystem_type", lambda path: "ext4")
    with RunLock(Storage(str(tmp_path)), settle_s=0.25):
        pass
    assert slept == [0.25, 0.0]


def test_a_run_whose_heartbeat_cannot_be_written_loses_the_lock_and_never_writes_it_again(tmp_path, monkeypatch):
    storage = Storage(str(tmp_path))
    lock = RunLock(storage, stale_after_s=1.0, settle_s=0)
    assert lock.heartbeat_s == 0.25  # a quarter of stale_after_s, when that is under 10 s
    lock.acquire()
    writes = []
    try:
        def outage():
            writes.append(time.time())
            raise OSError("storage unreachable")

        monkeypatch.setattr(lock, "_write", outage)
        time.sleep(1.5)  # an outage longer than a lock stays fresh: another run may take over
        assert lock.lost is not None and "could not write its heartbeat" in lock.lost
        with pytest.raises(LockLost, match="this run stopped \\(what it committed stays\\); rerun to resume"):
            lock.check()
        taker = RunLock(storage, stale_after_s=1.0, settle_s=0)
        taker.acquire()  # the stale record is taken over
        tried = len(writes)
        time.sleep(0.6)
        assert len(writes) == tried  # the lost holder's heartbeat has stopped: it never overwrites the taker's
        assert json.loads((tmp_path / "_lock.json").read_text())["owner"] == taker.owner
        lock.release()  # leaves the taker's record alone
        assert json.loads((tmp_path / "_lock.json").read_text())["owner"] == taker.owner
        taker.release()
    finally:
        lock._stop.set()


def test_a_run_that_finds_another_owner_in_the_record_loses_the_lock(tmp_path):
    storage = Storage(str(tmp_path))
    told = []
    with RunLock(storage, stale_after_s=2.0, settle_s=0, on_lost=told.append) as lock:
        lock.check(fresh=True)  # still ours
        plant(storage, owner="rival:2:y")
        with pytest.raises(LockLost, match=r"another run \(rival:2:y\) took over the lock"):
            lock.check(fresh=True)
        time.sleep(0.8)
        assert told == [lock.lost]  # once
        assert json.loads((tmp_path / "_lock.json").read_text())["owner"] == "rival:2:y"
        with pytest.raises(LockLost, match="rival:2:y"):
            owned_by(storage, lock.owner)
        owned_by(storage, "rival:2:y")
    assert json.loads((tmp_path / "_lock.json").read_text())["owner"] == "rival:2:y"
