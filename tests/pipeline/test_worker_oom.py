"""Out of memory inside a shard is not a job failure: the worker halves the engine's
max_batch_tokens and retries the shard. The allocation failure is injected by wrapping the
engine the worker builds (the test hook); the engine is builtin:echo, so no model loads."""
import dataclasses
import json

import pyarrow.parquet as pq
import pytest

from jobs.spec import load_spec
from pipeline.errors import FatalShardError
from pipeline.io import CommitRecord, Storage, list_inputs, plan_shards
from pipeline.run import PartTotals, ShardWorker
from pipeline.spec import Job
from pipeline.tasks import engines as engine_module

ALLOC_ERROR = "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to allocate"


def engine_failing_above(budget: int):
    """An engine factory whose engines fail like torch's host allocator above `budget` tokens."""
    real = engine_module.build_engine

    def build(config):
        engine = real(config)
        if config.max_batch_tokens > budget:
            def fail(*args, **kwargs):
                raise RuntimeError(f"{ALLOC_ERROR} {config.max_batch_tokens * 1 << 20} bytes")
            engine.generate = fail
        return engine

    return build


def shard_batch(tmp_path):
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt": f"row {i}"}) + "\n" for i in range(6)))
    storage = Storage(str(tmp_path / "in.jsonl"))
    (shard,) = plan_shards(storage, list_inputs(storage, "auto"), None, 1 << 20)
    return {**{k: [v] for k, v in dataclasses.asdict(shard).items()}, "done": [False], "committed": [None]}


def make_worker(tmp_path):
    spec = load_spec(None, ["model=builtin:echo", "engine.max_batch_tokens=8192", "sampling.max_tokens=2"],
                     input=str(tmp_path / "in.jsonl"), output=str(tmp_path / "out"))
    return ShardWorker(Job.of(spec))


def test_an_allocation_failure_halves_the_budget_and_the_shard_is_committed(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_module, "build_engine", engine_failing_above(2048))
    batch = shard_batch(tmp_path)
    worker = make_worker(tmp_path)
    result = worker(batch)
    record = result["record"][0].to_dict()
    assert record["oom_retries"] == 2 and record["oom_budgets"] == [4096, 2048]
    assert record["max_batch_tokens"] == 2048 and record["rows"] == 6 and record["errors"] == 0
    table = pq.read_table(record["path"])
    assert table["id"].to_pylist() == [f"in.jsonl:{i}" for i in range(6)]
    assert set(table["generated_text"].to_pylist()) == {"xx"}
    totals = PartTotals()
    totals.add(CommitRecord.from_dict(record))
    assert totals.result()["oom"] == {"retries": 2, "shards": 1, "budgets": [2048, 4096]}


def test_an_allocation_failure_at_every_budget_fails_the_job_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_module, "build_engine", engine_failing_above(0))
    batch = shard_batch(tmp_path)
    with pytest.raises(FatalShardError, match=r"out of memory at engine.max_batch_tokens=512 after 4 halvings") as err:
        make_worker(tmp_path)(batch)
    message = str(err.value)
    assert "\n" not in message and "engine.max_num_seqs (now " in message
    assert "engine.gpu_memory_utilization (now 0.9)" in message
    assert not (tmp_path / "out" / "data").exists()


def test_the_engine_is_built_and_run_on_one_thread_whatever_thread_calls_the_actor(tmp_path, monkeypatch):
    """Ray Data builds an actor on one thread and calls it on another; on CPU a second thread
    running torch gets a second OpenMP team, which made the engine ~0.65x slower. Every build
    (the first, and one after an allocation failure) and every generate runs on one thread."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    threads = []
    build = engine_failing_above(4096)

    def recording(config):
        threads.append(threading.get_ident())
        engine = build(config)
        generate = engine.generate

        def run(*args, **kwargs):
            threads.append(threading.get_ident())
            return generate(*args, **kwargs)
        engine.generate = run
        return engine

    monkeypatch.setattr(engine_module, "build_engine", recording)
    batch = shard_batch(tmp_path)
    worker = make_worker(tmp_path)
    with ThreadPoolExecutor(1) as other:  # as Ray Data calls an actor: not on the thread that built it
        record = other.submit(worker, batch).result()["record"][0].to_dict()
    assert record["oom_retries"] == 1 and record["rows"] == 6
    assert len(threads) == 4 and len(set(threads)) == 1 and threads[0] != threading.get_ident()


def engine_losing_a_rank(times: int, built: list):
    """An engine factory whose first `times` engines fail their pass the way a tensor-parallel
    engine does when a rank dies (RankError), as a real rank kill is too slow for this file;
    tests/engine/test_tensor_parallel_failures.py kills real ranks."""
    from engine.api.errors import RankError

    real = engine_module.build_engine

    def build(config):
        engine = real(config)
        built.append(engine)
        if len(built) <= times:
            def fail(*args, **kwargs):
                raise RankError("tensor-parallel rank 1 (pid 4242) was killed by signal 9; all ranks are stopped")
            engine.generate = fail
        return engine

    return build


def test_a_lost_rank_restarts_the_engine_and_the_shard_is_redone_once(tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(engine_module, "build_engine", engine_losing_a_rank(1, built))
    record = make_worker(tmp_path)(shard_batch(tmp_path))["record"][0].to_dict()
    assert len(built) == 2 and record["rows"] == 6 and record["errors"] == 0
    table = pq.read_table(record["path"])
    assert table["id"].to_pylist() == [f"in.jsonl:{i}" for i in range(6)]  # each row once


def test_ranks_lost_again_and_again_fail_the_shard_in_one_line(tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(engine_module, "build_engine", engine_losing_a_rank(99, built))
    with pytest.raises(FatalShardError, match=r"tensor-parallel ranks failed 3 times on one shard: RankError"):
        make_worker(tmp_path)(shard_batch(tmp_path))
    assert len(built) == 3 and not (tmp_path / "out" / "data").exists()
