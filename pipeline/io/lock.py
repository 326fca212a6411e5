"""A run lock on an output path, so two scheduled runs of one job never write it at once.

The lock is an object (`_lock.json`: owner, host, pid, heartbeat) next to the outputs, on the
same storage, so it works wherever the output lives. The holder rewrites its heartbeat every
`heartbeat_s`. A lock is stale when its heartbeat is older than `stale_after_s`, or when its
owner ran on this host and that process is gone; a stale lock is taken over.

A holder that finds another owner in the record, or cannot write its heartbeat for as long as a
lock stays fresh (so another run may take it over at any moment), has lost the lock: it never
writes the record again, `lost` names why, and `check()` raises LockLost. The run checks before
each commit (the engine actors read the record themselves: `owned_by`), the manifest and _SUCCESS.

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

from pipeline.errors import LockHeld, LockLost
from pipeline.io.storage import Storage


LOCAL_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "tmpfs", "overlay"})
"""Filesystems of one host's disks (or memory), where an OS lock is seen by every process that can write."""


class RunLock:
    """`with RunLock(storage): ...` holds the output's lock for the duration of a run."""

    def __init__(self, storage: Storage, stale_after_s: float = 120.0, heartbeat_s: float | None = None,
                 settle_s: float = 0.5, on_heartbeat=None, on_lost=None):
        self.storage = storage
        self.path = storage.path("_lock.json")
        self.stale_after_s = stale_after_s
        self.heartbeat_s = min(10.0, stale_after_s / 4) if heartbeat_s is None else heartbeat_s
        """Every 10 s, or a quarter of stale_after_s where that is shorter."""
        self.settle_s = settle_s
        self.on_heartbeat = on_heartbeat
        """Called with no arguments on every heartbeat (e.g. to record run progress)."""
        self.on_lost = on_lost
        """Called with the reason once, when the lock is lost (e.g. to stop the engine actors)."""
        self.lost: str | None = None
        """Why this run no longer holds the lock; None while it does."""
        self._written = 0.0  # when this run's record was last written
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.took_over: dict | None = None
        """The stale record this run replaced, if any."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self) -> dict | None:
        return read_record(self.storage)

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

    def check(self, fresh: bool = False) -> None:
        """Raises LockLost once the lock is lost; `fresh`: reads the record now as well (before the
        manifest and _SUCCESS)."""
        if fresh and self.lost is None:
            current = self.read()
            if current is None or current.get("owner") != self.owner:
                self._lose(taken_over(current, self.storage.url))
        if self.lost is not None:
            raise LockLost(f"{self.lost}; this run stopped (what it committed stays); rerun to resume once "
                           "the other run has ended")

    def _lose(self, reason: str) -> None:
        if self.lost is None:
            self.lost = reason
            if self.on_lost is not None:
                try:
                    self.on_lost(reason)
                except Exception:  # noqa: BLE001  the run learns it from check() all the same
                    pass

    def _overdue(self) -> bool:
        """Whether this run's record may look stale to another run by now (its last write too old)."""
        return time.time() - self._written > self.stale_after_s - self.heartbeat_s

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
        now = time.time()
        record = {"owner": self.owner, "host": socket.gethostname(), "pid": os.getpid(), "heartbeat": now}
        self.storage.write_atomic(self.path, json.dumps(record).encode())
        self._written = now

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                # on a local disk no acquirer checks and writes between this read and this write
                with self._one_at_a_time():
                    current = self.read()
                    if current is None or current.get("owner") != self.owner:
                        self._lose(taken_over(current, self.storage.url))
                    elif self._overdue():
                        self._lose(unwritten(self))
                    else:
                        self._write()
                if self.lost is not None:
                    return  # the record is another run's now, or may be at any moment: never written again
                if self.on_heartbeat is not None:
                    self.on_heartbeat()
            except Exception:  # noqa: BLE001  (a missed heartbeat is retried on the next tick)
                if self._overdue():
                    self._lose(unwritten(self))
                    return


def taken_over(current: dict | None, url: str) -> str:
    if current is None:
        return f"the lock on {url} was removed while this run held it"
    return f"another run ({current.get('owner')}) took over the lock on {url}"


def unwritten(lock: RunLock) -> str:
    age = time.time() - lock._written
    return (f"this run could not write its heartbeat on {lock.storage.url} for {age:.0f}s (a lock is stale after "
            f"{lock.stale_after_s:g}s), so another run may have taken it over")


def read_record(storage: Storage) -> dict | None:
    """The output's lock record, None where there is none (an unreadable one names no owner)."""
    try:
        return json.loads(storage.read_text(storage.path("_lock.json")))
    except FileNotFoundError:
        return None
    except ValueError:
        return {"owner": "unreadable", "heartbeat": 0}


def owned_by(storage: Storage, owner: str) -> None:
    """Raises LockLost unless the output's lock record names `owner` (an engine actor, before it
    commits a shard of the run that owner started)."""
    current = read_record(storage)
    if current is None or current.get("owner") != owner:
        raise LockLost(f"{taken_over(current, storage.url)}; this run stopped before committing more")


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
