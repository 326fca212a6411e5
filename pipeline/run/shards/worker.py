"""The engine actors: one engine each; a job's ShardWorker turns whole shards into committed parts."""
from __future__ import annotations

import gc
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from engine.api import CPU_POOL_TOKENS, EngineFacts
from engine.api import RankError, one_line
from pipeline.errors import FatalShardError, LockLost
from pipeline.io import CommitRecord, OutputDir, Shard, Storage, owned_by, read_shard, with_retries
from pipeline.run.shards import chaos
from pipeline.tasks import empty_device_cache, is_out_of_memory, output_table, start_engine

if TYPE_CHECKING:
    from pipeline.spec import Job, Row

MAX_OOM_HALVINGS = 4
"""Times a shard is retried at half the engine's max_batch_tokens before the job fails."""
MAX_RANK_RESTARTS = 2
"""Times a shard is redone on a restarted engine after a tensor-parallel rank died or hung."""

log = logging.getLogger(__name__)


class EngineActor:
    """A Ray Data actor holding one engine. A constructor that raises makes Ray restart the actor
    again and again; a failed setup is instead reported by the first call (`check_setup`), which
    fails the job or the dataset with this one line.

    All of the actor's torch work, the engine's build and every call, runs on one thread of its
    own (`on_engine_thread`). Ray Data constructs the actor on one thread and calls it on another,
    and on CPU each thread that runs torch ops gets its own OpenMP team: with two teams on the
    node's cores libgomp stops spinning and sleeps at every barrier, and the engine ran at ~0.65x
    of its speed in one thread (scripts/bench_scale.py --bare; docs/SCALE.md)."""

    def __init__(self, *args, **kwargs):
        self.setup_error = None
        self._engine_thread = ThreadPoolExecutor(1, thread_name_prefix="engine")
        try:
            self.on_engine_thread(self._setup, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            self.setup_error = f"worker setup failed on {socket.gethostname()}: {one_line(exc)}"

    def on_engine_thread(self, fn, *args, **kwargs):
        """fn(*args, **kwargs), run on the actor's engine thread; its exception is raised here."""
        return self._engine_thread.submit(fn, *args, **kwargs).result()

    def _setup(self, *args, **kwargs) -> None:
        raise NotImplementedError

    def check_setup(self) -> None:
        if self.setup_error:
            raise FatalShardError(self.setup_error)


class ShardWorker(EngineActor):
    """Ray Data actor: `__call__` takes a batch of shard descriptors, reads each shard, runs the
    engine on its rows, and commits one output part per shard. Returns one summary per shard."""

    def _setup(self, job: Job, stop=None, lock_owner: str | None = None) -> None:
        chaos.point("init")
        self.job = job
        self.stop = stop  # a StopSignal actor (pipeline.run.shards.dataflow), asked before each shard
        self.lock_owner = lock_owner
        """The run lock's owner (pipeline.io.lock): the record must still name it when a shard commits."""
        self.spec = spec = job.spec
        self.stage = spec.stage()
        self.input = Storage(spec.input.path, spec.input.storage_options)
        self.output = OutputDir(Storage(spec.output.path, spec.output.storage_options), spec.output.format)
        self.engine_config = spec.engine_config()
        self._build_engine()
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}"
        self.last_done = 0.0

    def __call__(self, batch: dict) -> dict:
        """One CommitRecord per shard: its identity, counts and times. A shard the
        planner found committed already is passed through with its record, without work."""
        self.check_setup()
        return self.on_engine_thread(self._shards, batch)

    def _shards(self, batch: dict) -> dict:
        records, new = [], []
        for shard, done, record in zip(Shard.from_batch(batch), batch["done"], batch["committed"]):
            if self.stop is not None and not done:
                import ray

                reason = ray.get(self.stop.get.remote())
                if reason is not None:  # the driver stopped the job (a duplicate id): no more shards
                    raise FatalShardError(reason)
            records.append(record if done else self.process(shard))
            new.append(not done)
        out = np.empty(len(records), dtype=object)  # CommitRecords, as Ray Data's object columns carry them
        out[:] = records
        return {"record": out, "new": np.array(new, dtype=bool)}

    def process(self, shard: Shard) -> CommitRecord:
        started = time.perf_counter()
        idle = started - self.last_done if self.last_done else 0.0
        rows = with_retries(lambda: read_shard(self.input, shard), f"reading {shard.name}")
        read = time.perf_counter()
        rows, skipped = self._bad_lines(rows)
        rows = self._ids(rows)
        results, budgets = self._run_tasks(rows, shard.adapter if shard.lora_each else None)
        engine = time.perf_counter()
        lines = self.output.format == "openai_batch"  # one line per request, with its n choices
        table = (self._openai_lines(rows, results) if lines
                 else output_table(self.stage, rows, results, self.tasks.embedding_width))
        cached = sum(r.cached_prompt_tokens(per_sample=not lines) for r in results)
        counts = self.output.counted(table)  # as a recount of the committed part gives them
        facts = self.engine.facts()  # once per shard: its pool and what the part record says of the engine
        record = replace(counts, **self.output.identity(shard), skipped=skipped, worker=self.worker_id,
                         cached_prompt_tokens=cached,
                         read_seconds=read - started, engine_seconds=engine - read, idle_seconds=idle,
                         oom_retries=len(budgets), oom_budgets=budgets,
                         max_batch_tokens=self._pool_tokens(facts), engine=facts.record())
        chaos.point("shard")
        before_commit = time.perf_counter()
        record.seconds = before_commit - started
        if self.lock_owner is not None:
            try:
                with_retries(lambda: owned_by(self.output.storage, self.lock_owner), "reading the run lock")
            except LockLost as exc:  # another run took the output over: this one commits nothing more
                raise FatalShardError(str(exc)) from None
        with_retries(lambda: self.output.commit(shard.key, table, record), f"committing shard {shard.key}")
        self.last_done = time.perf_counter()
        record.commit_seconds = self.last_done - before_commit
        record.committed_at = time.time()
        record.seconds = self.last_done - started
        return record

    def _run_tasks(self, rows, adapter: str | None = None) -> tuple[list, list[int]]:
        """The task's results for the rows. Out of memory (accelerator or host) is not the job's
        failure: the engine is rebuilt with half its max_batch_tokens and the shard retried,
        up to MAX_OOM_HALVINGS times. Returns the records and the budgets retried at."""
        budgets: list[int] = []
        restarts = 0
        while True:
            try:
                return self.tasks.run(rows, adapter), budgets  # rows are never changed: a retry starts afresh
            except RankError as exc:  # a tensor-parallel rank died or hung; the engine stopped them all
                if restarts == MAX_RANK_RESTARTS:
                    raise FatalShardError(f"tensor-parallel ranks failed {restarts + 1} times on one shard: "
                                          f"{one_line(exc)}") from exc
                restarts += 1
                log.warning("%s: restarting the engine and redoing the shard (nothing of it was committed)",
                            one_line(exc))
                self._restart_engine()
                continue
            except Exception as exc:  # noqa: BLE001
                if not is_out_of_memory(exc):
                    raise
                if len(budgets) == MAX_OOM_HALVINGS or self._pool_tokens() < 2:
                    cfg = self.engine_config
                    raise FatalShardError(f"out of memory at engine.max_batch_tokens="
                                          f"{self._pool_tokens()} after {len(budgets)} halvings: "
                                          f"{one_line(exc)}; halving the KV budget cannot help: lower "
                                          f"engine.max_num_seqs (now {cfg.max_num_seqs}) or "
                                          f"engine.gpu_memory_utilization (now {cfg.gpu_memory_utilization}), "
                                          "or run on a larger device") from exc
                budgets.append(self._halve_budget())

    def _pool_tokens(self, facts: EngineFacts | None = None) -> int:
        """The KV pool's tokens: the configured max_batch_tokens, else what the engine sized (`facts`:
        the engine's, when the caller has them)."""
        if self.engine_config.max_batch_tokens is not None:
            return self.engine_config.max_batch_tokens
        return (facts or self.engine.facts()).pool_tokens or CPU_POOL_TOKENS

    def _halve_budget(self) -> int:
        budget = self._pool_tokens() // 2
        self.engine_config = replace(self.engine_config, max_batch_tokens=budget)
        log.warning("out of memory on a shard: rebuilding the engine with max_batch_tokens=%d", budget)
        self.engine.close()  # its tensor-parallel ranks, and their memory, go before the new one loads
        self.engine = self.tasks = None  # let the old engine's memory go before the new one loads
        gc.collect()
        empty_device_cache()
        self._build_engine()
        return budget

    def _restart_engine(self) -> None:
        self.engine.close()
        self.engine = self.tasks = None
        gc.collect()
        empty_device_cache()  # the next engine sizes its pool from what the card has free
        self._build_engine()

    def _build_engine(self) -> None:
        self.engine, self.tasks = start_engine(self.stage, self.spec.workers, config=self.engine_config)

    def _bad_lines(self, rows: list[Row]) -> tuple[list[Row], int]:
        """Applies input.on_bad_line to lines that did not parse: error (keep as error rows),
        skip (leave out, counted), fail (stop the job naming the line)."""
        policy = self.spec.input.on_bad_line
        bad = [row for row in rows if row.error is not None]
        if not bad or policy == "error":
            return rows, 0
        if policy == "fail":
            raise FatalShardError(bad[0].error)
        return [row for row in rows if row.error is None], len(bad)

    def _ids(self, rows: list[Row]) -> list[Row]:
        """The rows with their id column's ids (a missing one is the row's error); a duplicate is fatal."""
        column = self.spec.input.id_column
        if not column:
            return rows
        out, seen = [], set()
        for row in rows:
            value = row.get(column)
            if value is None:  # the row keeps its derived id
                row = row.failing(f"id column {column!r} is missing or null")
            value = row.id if value is None else str(value)
            if value in seen:
                raise FatalShardError(f"duplicate id {value!r} in column {column!r}")
            seen.add(value)
            out.append(replace(row, id=value))
        return out

    def _openai_lines(self, rows: list[Row], results) -> pa.Table:
        """OpenAI Batch output: one response (or error) line per row, as JSON text."""
        lines = self.tasks.openai_lines(rows, results, self.job.created or int(time.time()))
        return pa.table({"line": pa.array(lines, pa.string())})
