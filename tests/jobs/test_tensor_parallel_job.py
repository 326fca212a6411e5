"""A job with engine.tensor_parallel_size 2 on CPU: every row once, the same text as one process,
and no rank process left once the job is over."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.distributed.ranks import RANK_NAME
from helpers import read_output, write_jsonl
from pipeline.run import run_job
from pipeline.spec import Job, validate

pytestmark = [pytest.mark.usefixtures("ray_local"), pytest.mark.timeout(300)]


def rank_processes() -> set[int]:
    """Pids of live processes started as the engine's ranks (their process name is
    batchinfer-tp<rank>), by this test process or its Ray: with the suite spread over processes
    (pytest -n), another one's ranks carry another PYTEST_XDIST_WORKER in their environment."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or not (entry / "comm").read_text().startswith(RANK_NAME):
                continue
            if worker and f"PYTEST_XDIST_WORKER={worker}".encode() not in (entry / "environ").read_bytes().split(b"\0"):
                continue
        except OSError:  # gone meanwhile
            continue
        found.add(int(entry.name))
    return found


def ranks_gone(before: set[int], within_s: float = 10.0) -> bool:
    """Whether every rank started since `before` exits within `within_s` (a rank polls its
    parent's pid every 0.2 s; an actor that ended takes that long to be noticed)."""
    deadline = time.monotonic() + within_s
    while rank_processes() - before:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_every_row_once_and_as_one_process_gives_it(tmp_path):
    prompts = [f"row {i} says" for i in range(10)]
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": p} for p in prompts])
    before = rank_processes()
    job = Job.of(validate({"model": "builtin:tiny", "input": {"path": str(tmp_path / "in.jsonl")},
                           "output": {"path": str(tmp_path / "out")},
                           "sampling": {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True},
                           "engine": {"max_batch_tokens": 2048, "tensor_parallel_size": 2},
                           "workers": {"num": 1, "rows_per_batch": 4}}))
    seen, done = set(), threading.Event()

    def watch():  # the ranks the job starts, seen while it runs
        while not done.is_set():
            seen.update(rank_processes() - before)
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        result = run_job(job, progress=lambda msg: None)
    finally:
        done.set()
        watcher.join()

    assert result.status == "complete" and result.rows == 10
    out = sorted(read_output(tmp_path / "out").to_pylist(), key=lambda r: int(r["id"].rsplit(":", 1)[1]))
    assert [r["id"] for r in out] == [f"in.jsonl:{i}" for i in range(10)]
    llm = LLMEngine(EngineConfig(model="builtin:tiny", max_batch_tokens=2048))
    expected = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [r["generated_text"] for r in out] == [c.text for c in expected]
    assert all(r["error"] is None and r["num_generated_tokens"] == 8 for r in out)
    assert seen, "no rank process ran: the job did not run tensor-parallel"
    assert ranks_gone(before), f"rank processes outlived the job: {sorted(rank_processes() - before)}"
