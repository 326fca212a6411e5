"""Fault injection for reliability tests: break a job at a named point, on purpose.

Set `BATCHINFER_CHAOS` to `POINT:ACTION[:ONCE_FILE]` (several separated by `;`). At POINT the
process performs ACTION; with ONCE_FILE only the first process to create that file does
(so a restarted actor or a rerun gets through). Unset, every hook is a no-op.

Points: driver `listed` (files listed, shards not yet planned), `generated` (every shard
committed, manifest not written), `manifest` (manifest written, _SUCCESS not); worker `init`
(actor constructor), `shard` (a shard generated, its part not yet committed).
Actions: `kill` (SIGKILL the whole process group: a crashed machine), `exit` (os._exit(1):
a crashed process), `raise` (an exception), `sleep=SECONDS`.
"""
from __future__ import annotations

import os
import signal
import time

ENV = "BATCHINFER_CHAOS"


class InjectedFault(RuntimeError):
    """Raised by the `raise` action."""


def point(name: str) -> None:
    """Performs the fault configured for `name`, if any."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    for item in spec.split(";"):
        where, _, rest = item.strip().partition(":")
        action, _, once = rest.partition(":")
        if where != name or (once and not _first(once)):
            continue
        if action == "kill":
            os.killpg(os.getpgid(0), signal.SIGKILL)
        elif action == "exit":
            os._exit(1)
        elif action == "raise":
            raise InjectedFault(f"injected fault at {name}")
        elif action.startswith("sleep="):
            time.sleep(float(action.split("=", 1)[1]))


def forwarded_env() -> dict:
    """Environment for Ray workers, so faults reach actors of an already running cluster."""
    return {ENV: os.environ[ENV]} if os.environ.get(ENV) else {}


def _first(path: str) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True
