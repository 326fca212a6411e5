"""A run lock on an output path, so two scheduled runs of one job never write it at once.

The lock is an object (`_lock.json`: owner, host, pid, heartbeat) next to the outputs, on the
same storage, so it works wherever the output lives. The holder rewrites its heartbeat every
`heartbeat_s`. A lock is stale when its heartbeat is older than `stale_after_s`, or when its
owner ran on this host and that process is gone; a stale lock is taken over.

Object stores have no portable create-if-absent, so acquiring there is write-then-verify: write
our record, wait `settle_s`, read it back; whoever's record survives holds the lock. On a local
directory the check-and-write also runs under an OS lock on the directory (flock), one process at
a time (the kernel lets it go when its holder dies, so a killed run leaves nothing to wait on); on
a local disk's filesystem that is the whole guard and there is no wait. A mounted one (NFS, FUSE,
SMB) may keep such locks to one host, so its writes still settle.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid

try:
    import fcntl
except ImportError:  # Windows: acquiring falls back to write-then-verify
    fcntl = None

from pipeline.errors import LockHeld
from pipeline.io.storage import Storage


LOCAL_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "tmpfs", "overlay"})
"""Filesystems of one host's disks (or memory), where an OS lock is seen by every process that can write."""


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
        with self._one_at_a_time() as exclusive:
            self._acquire(settle_s=0.0 if exclusive else self.settle_s)
        self._thread = threading.Thread(target=self._beat, name="batchinfer-lock-heartbeat", daemon=True)
        self._thread.start()

    def _acquire(self, settle_s: float) -> None:
        current = self.read()
        if current is not None and current.get("owner") != self.owner:
            if not self.is_stale(current):
                age = time.time() - float(current.get("heartbeat", 0))
                raise LockHeld(f"another run ({current.get('owner')}, heartbeat {age:.0f}s ago) is writing "
                               f"{self.storage.url}; it is taken over once its heartbeat is "
                               f"{self.stale_after_s:.0f}s old")
            self.took_over = current
        self._write()
        time.sleep(settle_s)
        winner = self.read()
        if winner is None or winner.get("owner") != self.owner:
            raise LockHeld(f"another run ({(winner or {}).get('owner')}) took the lock on {self.storage.url} "
                           "at the same moment")

    @contextlib.contextmanager
    def _one_at_a_time(self):
        """Yields True while this process alone may check and write the record: an OS lock on the
        output's directory, on a local disk's filesystem. False elsewhere (an object store, a
        mounted filesystem, a platform without flock): then the write is verified after settle_s."""
        if not self.storage.is_local or fcntl is None:
            yield False
            return
        os.makedirs(self.storage.root, exist_ok=True)
        fd = os.open(self.storage.root, os.O_RDONLY)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                exclusive = filesystem_type(self.storage.root) in LOCAL_FILESYSTEMS
            except OSError:  # a filesystem without flock
                exclusive = False
            yield exclusive
        finally:
            os.close(fd)  # closing the descriptor lets the OS lock go

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


def filesystem_type(path: str) -> str | None:
    """The type of the filesystem `path` is on (Linux's /proc/self/mounts), or None."""
    try:
        mounts = [line.split()[1:3] for line in open("/proc/self/mounts", encoding="utf-8")]
    except OSError:
        return None
    path = os.path.realpath(path)
    best, kind = "", None
    for point, fstype in mounts:
        point = point.replace("\\040", " ")
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, fstype
    return kind


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
