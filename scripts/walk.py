#!/usr/bin/env python
"""The walk of one job: the product's functions a newcomer reads, in the order a job first calls
them, from `batchinfer run` to its first written part, and how often the walk comes back to a file it
had left (the measure of the house issue: fewer files, fewer returns).

Runs a small JSONL job on builtin:echo (one shard) in this process: the CLI and the driver up to the
Ray Data pipeline (whose actors are other processes: the walk stops there), then one shard through a
ShardWorker in this process, as an engine actor runs it, to its committed part. Every function of
engine/, pipeline/ or jobs/ called for the first time is one step; a step into a file the walk had
already left is a return.

    .venv/bin/python scripts/walk.py [--steps] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = tuple(str(ROOT / top) + "/" for top in ("engine", "pipeline", "jobs"))


class Walk:
    """First calls of product functions, in order (a profile hook on every thread)."""

    def __init__(self):
        self.steps: list[tuple[str, str]] = []
        self.seen: set = set()
        self.lock = threading.Lock()

    def hook(self, frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(PRODUCT) or code.co_name in ("<module>", "<genexpr>", "<lambda>") \
                or code.co_name.startswith("<"):
            return
        key = (code.co_filename, code.co_firstlineno)
        with self.lock:
            if key not in self.seen:
                self.seen.add(key)
                self.steps.append((str(Path(code.co_filename).relative_to(ROOT)), code.co_qualname))

    def __enter__(self):
        threading.setprofile(self.hook)
        sys.setprofile(self.hook)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)
        threading.setprofile(None)

    def summary(self) -> dict:
        files, returns, left = [], 0, set()
        for i, (path, _) in enumerate(self.steps):
            if i and path != self.steps[i - 1][0]:
                left.add(self.steps[i - 1][0])
                returns += path in left
            if path not in files:
                files.append(path)
        return {"steps": len(self.steps), "files": len(files), "returns": returns, "file_order": files}


class HandedToRay(Exception):
    """The driver reached the Ray Data pipeline: its actors' part of the walk runs here instead."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", action="store_true", help="print every step (file: function)")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args()

    from click.testing import CliRunner

    import pipeline.run.driver as driver
    from jobs.cli import main as cli
    from jobs.spec import load_spec
    from pipeline.io import Storage, list_inputs, plan_shards
    from pipeline.run.shards.worker import ShardWorker
    from pipeline.spec import Job

    tmp = Path(tempfile.mkdtemp(prefix="walk-"))
    (tmp / "in.jsonl").write_text("".join(json.dumps({"prompt": f"row {i}"}) + "\n" for i in range(8)))
    sets = ["model=builtin:echo", "sampling.max_tokens=2"]
    flags = [x for s in sets for x in ("--set", s)]

    def handed(*a, **k):
        raise HandedToRay()

    driver.execute = handed  # the driver's walk ends where Ray Data takes the shards
    walk = Walk()
    with walk:
        CliRunner().invoke(cli, ["run", "--input", str(tmp / "in.jsonl"), "--output", str(tmp / "out"), *flags],
                           catch_exceptions=True)
        spec = load_spec(None, sets, input=str(tmp / "in.jsonl"), output=str(tmp / "out"))
        job = Job.of(spec)
        storage = Storage(spec.input.path)  # the one shard a planning task cuts of this small file
        (shard,) = list(plan_shards(storage, list_inputs(storage, "auto"), None, spec.workers.shard_bytes))
        worker = ShardWorker(job)
        worker({**{k: [v] for k, v in asdict(shard).items()}, "done": [False], "committed": [None]})
    parts = list((tmp / "out" / "data").iterdir())
    if len(parts) != 1:
        sys.exit(f"walk: expected one written part, found {len(parts)}")
    summary = walk.summary()
    if args.steps:
        for path, name in walk.steps:
            print(f"  {path}: {name}")
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(f"from `batchinfer run` to a written part: {summary['steps']} functions in {summary['files']} files, "
              f"{summary['returns']} returns to a file already left")


if __name__ == "__main__":
    main()
