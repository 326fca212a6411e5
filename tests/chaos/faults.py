"""The faults behind pipeline.run.shards.chaos's hook: break a job at a named point, on purpose.

A job runs them with `BATCHINFER_CHAOS_HOOK=chaos.faults` (tests/ on PYTHONPATH; see
`harness.hook_env`) and `BATCHINFER_CHAOS` set to `POINT[#K]:ACTION[:ONCE_FILE]`, several separated
by `;`. At POINT the process performs ACTION; with #K only the K-th time this process reaches
POINT (e.g. `shard#2`: an actor's second shard, after its first was committed); with ONCE_FILE
only the first process to create that file does (so a restarted actor or a rerun gets through).

Actions: `kill` (SIGKILL the whole process group: a crashed machine), `exit` (os._exit(1): a
crashed process), `raise` (an exception), `sleep=SECONDS`, `record=FILE` (appends a JSON line
{point, node, pid, time} to FILE: where and when the point ran, the evidence a scenario checks).
"""
from __future__ import annotations

import json
import os
import signal
import time

ENV = "BATCHINFER_CHAOS"


class InjectedFault(RuntimeError):
    """Raised by the `raise` action."""


_reached: dict[str, int] = {}
"""Times this process reached each point."""


def point(name: str) -> None:
    """Performs the fault configured for `name`, if any."""
    _reached[name] = _reached.get(name, 0) + 1
    for item in os.environ.get(ENV, "").split(";"):
        where, _, rest = item.strip().partition(":")
        action, _, once = rest.partition(":")
        where, _, nth = where.partition("#")
        if where != name or (nth and _reached[name] != int(nth)) or (once and not _first(once)):
            continue
        if action == "kill":
            os.killpg(os.getpgid(0), signal.SIGKILL)
        elif action == "exit":
            os._exit(1)
        elif action == "raise":
            raise InjectedFault(f"injected fault at {name}")
        elif action.startswith("sleep="):
            time.sleep(float(action.split("=", 1)[1]))
        elif action.startswith("record="):
            _record(action.split("=", 1)[1], name)


def read_records(path: str) -> list[dict]:
    """The lines `record=` appended to `path` (none if it was never written)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _record(path: str, name: str) -> None:
    import ray

    node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    line = json.dumps({"point": name, "node": node, "pid": os.getpid(), "time": time.time()}) + "\n"
    fd = os.open(path, os.O_CREAT | os.O_APPEND | os.O_WRONLY)  # one short append: whole lines
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _first(path: str) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True
