"""A run lock on an output path, so two scheduled runs of one job never write it at once.

The lock is an object (`_lock.json`: owner, host, pid, heartbeat) next to the outputs, on the
same storage, so it works wherever the output lives. The holder rewrites its heartbeat every
`heartbeat_s`. A lock is stale when its heartbeat is older than `stale_after_s`, or when its
owner ran on this host and that process is gone; a stale lock is taken over.

Object stores have no portable create-if-absent, so acquiring is write-then-verify: write our
record, wait a moment, read it back; whoever's record survives holds the lock.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid

from pipeline.errors import LockHeld
from pipeline.io.storage import Storage


class RunLock:
    """`with RunLock(storage): ...` holds the output's lock for the duration of a run."""

    def __init__(self, storage: Storage, stale_after_s: float = 120.0, heartbeat_s: float = 10.0,
                 settle_s: float = 0.5, on_heartbeat=None):
        self.storage = storage
        self.path = storage.path("_lock.json")
        self.stale_after_s = stale_after_s
        self.heartbeat_s = heartbeat_s
        self.settle_s = settle_s
        self.on_heartbeat = on_heartbeat
        """Called with no arguments on every heartbeat (e.g. to record run progress)."""
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.took_over: dict | None = None
        """The stale record this run replaced, if any."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self) -> dict | None:
        try:
            return json.loads(self.storage.read_text(self.path))
        except FileNotFoundError:
            return None
        except ValueError:
            return {"owner": "unreadable", "heartbeat": 0}

    def is_stale(self, record: dict, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        if now - float(record.get("heartbeat", 0)) > self.stale_after_s:
            return True
        return record.get("host") == socket.gethostname() and not _pid_alive(record.get("pid"))

    def acquire(self) -> None:
        current = self.read()
        if current is not None and current.get("owner") != self.owner:
            if not self.is_stale(current):
                age = time.time() - float(current.get("heartbeat", 0))
                raise LockHeld(f"another run ({current.get('owner')}, heartbeat {age:.0f}s ago) is writing "
                               f"{self.storage.url}; it is taken over once its heartbeat is "
                               f"{self.stale_after_s:.0f}s old")
            self.took_over = current
        self._write()
        time.sleep(self.settle_s)
        winner = self.read()
        if winner is None or winner.get("owner") != self.owner:
            raise LockHeld(f"another run ({(winner or {}).get('owner')}) took the lock on {self.storage.url} "
                           "at the same moment")
        self._thread = threading.Thread(target=self._beat, name="batchinfer-lock-heartbeat", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        current = self.read()
        if current is not None and current.get("owner") == self.owner:
            self.storage.fs.rm(self.path)

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _write(self) -> None:
        record = {"owner": self.owner, "host": socket.gethostname(), "pid": os.getpid(), "heartbeat": time.time()}
        self.storage.write_atomic(self.path, json.dumps(record).encode())

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                current = self.read()
                if current is not None and current.get("owner") != self.owner:
                    return  # taken over after we looked stale: the newer run owns the output now
                self._write()
                if self.on_heartbeat is not None:
                    self.on_heartbeat()
            except Exception:  # noqa: BLE001  (a missed heartbeat is retried on the next tick)
                continue


def _pid_alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
