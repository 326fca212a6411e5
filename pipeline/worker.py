"""Generate stage: an actor holding one engine, turning whole shards into committed parts."""
from __future__ import annotations

import gc
import json
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING

import pyarrow as pa

from engine import EngineConfig, LLMEngine
from engine.echo import ECHO_MODEL, EchoEngine
from engine.errors import one_line
from pipeline import chaos
from pipeline import openai_batch as oai
from pipeline.planner import shard_identity
from pipeline.sink import OutputDir, summarize
from pipeline.source import Shard, read_shard
from pipeline.storage import Storage, with_retries
from pipeline.tasks import TaskRunner, column_type, output_columns, request_for

if TYPE_CHECKING:
    from pipeline.job import Job
    from pipeline.spec import JobSpec


MAX_OOM_HALVINGS = 4
"""Times a shard is retried at half the engine's max_batch_tokens before the job fails."""

OOM_MARKERS = ("out of memory", "DefaultCPUAllocator")
"""Texts of allocation failures that torch raises as plain RuntimeErrors (host memory)."""

log = logging.getLogger(__name__)


class FatalShardError(RuntimeError):
    """A shard that can never succeed (e.g. duplicate ids): the job must stop."""


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


def start_engine(spec: JobSpec, prompts=None, config: EngineConfig | None = None) -> tuple[LLMEngine, TaskRunner]:
    """The engine for `spec` (or for `config`, e.g. at a halved budget; its CPU threads shared
    among the node's actors) and its task runner."""
    if not spec.workers.gpus:
        _share_cpu_threads(spec.workers.num)
    engine = build_engine(config or spec.engine_config())
    return engine, TaskRunner(spec, engine, prompts)


class ShardWorker(EngineActor):
    """Ray Data actor: `__call__` takes a batch of shard descriptors, reads each shard, runs the
    engine on its rows, and commits one output part per shard. Returns one summary per shard."""

    def _setup(self, job: Job) -> None:
        chaos.point("init")
        self.job = job
        self.spec = spec = job.spec
        self.input = Storage(spec.input.path, spec.input.storage_options)
        self.output = OutputDir(Storage(spec.output.path, spec.output.storage_options), spec.output.format)
        self.engine_config = spec.engine_config()
        self._build_engine()
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}"
        self.last_done = 0.0

    def __call__(self, batch: dict) -> dict:
        """One commit record (JSON) per shard: its identity, counts and times. A shard the
        planner found committed already is passed through with its record, without work."""
        self.check_setup()
        return self.on_engine_thread(self._shards, batch)

    def _shards(self, batch: dict) -> dict:
        records, new = [], []
        for shard, done in zip(Shard.from_batch(batch), batch["committed"]):
            records.append(str(done) if done else json.dumps(self.process(shard)))
            new.append(not done)
        return {"record": records, "new": new}

    def process(self, shard: Shard) -> dict:
        started = time.perf_counter()
        idle = started - self.last_done if self.last_done else 0.0
        rows, ids, errors = with_retries(lambda: read_shard(self.input, shard), f"reading {shard.name}")
        read = time.perf_counter()
        rows, ids, errors, skipped = self._bad_lines(rows, ids, errors)
        ids = self._ids(rows, ids, errors)
        cached_before = _cached_tokens(self.engine)
        records, budgets = self._run_tasks(rows, ids, errors)
        engine = time.perf_counter()
        table = output_table(self.spec, rows, ids, records)
        summary = summarize(table)
        summary["cached_prompt_tokens"] = _cached_tokens(self.engine) - cached_before
        if self.output.format == "openai_batch":
            table = self._openai_lines(rows, ids, records)
        summary.update(shard_identity(self.output, shard), skipped=skipped, worker=self.worker_id,
                       read_seconds=read - started, engine_seconds=engine - read, idle_seconds=idle,
                       oom_retries=len(budgets), oom_budgets=budgets,
                       max_batch_tokens=self.engine_config.max_batch_tokens)
        chaos.point("shard")
        before_commit = time.perf_counter()
        summary["seconds"] = before_commit - started
        with_retries(lambda: self.output.commit(shard.key, table, summary), f"committing shard {shard.key}")
        self.last_done = time.perf_counter()
        summary["commit_seconds"] = self.last_done - before_commit
        summary["committed_at"] = time.time()
        summary["seconds"] = self.last_done - started
        return summary

    def _run_tasks(self, rows, ids, errors) -> tuple[list[dict], list[int]]:
        """The task's records for the rows. Out of memory (accelerator or host) is not the job's
        failure: the engine is rebuilt with half its max_batch_tokens and the shard retried,
        up to MAX_OOM_HALVINGS times. Returns the records and the budgets retried at."""
        budgets: list[int] = []
        while True:
            attempt = list(errors)  # the task marks failed rows in place; each try starts afresh
            try:
                records = self.tasks.run(rows, ids, attempt)
                errors[:] = attempt
                return records, budgets
            except Exception as exc:  # noqa: BLE001
                if not is_out_of_memory(exc):
                    raise
                if len(budgets) == MAX_OOM_HALVINGS or self._pool_tokens() < 2:
                    raise FatalShardError(f"out of memory at engine.max_batch_tokens="
                                          f"{self._pool_tokens()} after {len(budgets)} halvings: "
                                          f"{one_line(exc)}") from exc
                budgets.append(self._halve_budget())

    def _pool_tokens(self) -> int:
        """The KV pool's tokens: the configured max_batch_tokens, else what the engine sized."""
        if self.engine_config.max_batch_tokens is not None:
            return self.engine_config.max_batch_tokens
        return getattr(self.engine, "pool_tokens", None) or 8192

    def _halve_budget(self) -> int:
        config = self.engine_config
        budget = self._pool_tokens() // 2
        self.engine_config = replace(config, max_batch_tokens=budget)
        log.warning("out of memory on a shard: rebuilding the engine with max_batch_tokens=%d", budget)
        self.engine = self.tasks = None  # let the old engine's memory go before the new one loads
        gc.collect()
        _empty_device_cache()
        self._build_engine()
        return budget

    def _build_engine(self) -> None:
        self.engine, self.tasks = start_engine(self.spec, config=self.engine_config)

    def _bad_lines(self, rows, ids, errors):
        """Applies input.on_bad_line to lines that did not parse: error (keep as error rows),
        skip (leave out, counted), fail (stop the job naming the line)."""
        policy = self.spec.input.on_bad_line
        bad = [i for i, e in enumerate(errors) if e is not None]
        if not bad or policy == "error":
            return rows, ids, errors, 0
        if policy == "fail":
            raise FatalShardError(errors[bad[0]])
        keep = [i for i, e in enumerate(errors) if e is None]
        return [rows[i] for i in keep], [ids[i] for i in keep], [None] * len(keep), len(bad)

    def _ids(self, rows: list[dict], derived: list[str], errors: list) -> list[str]:
        column = self.spec.input.id_column
        if not column:
            return derived
        ids, seen = [], set()
        for i, row in enumerate(rows):
            value = row.get(column)
            if value is None:
                if errors[i] is None:
                    errors[i] = f"id column {column!r} is missing or null"
                value = derived[i]
            value = str(value)
            if value in seen:
                raise FatalShardError(f"duplicate id {value!r} in column {column!r}")
            seen.add(value)
            ids.append(value)
        return ids

    def _openai_lines(self, rows, ids, records) -> pa.Table:
        """OpenAI Batch output: one response (or error) line per row, as JSON text."""
        created, lines = self.job.created or int(time.time()), []
        tokenizer = self.engine.tokenizer
        for row, row_id, rec in zip(rows, ids, records):
            req = rec.get("_request")
            if rec["finish_reason"] == "error":
                custom_id = row.get("custom_id") if isinstance(row.get("custom_id"), str) else None
                code = oai.GENERATION_ERROR if rec.get("_ran") else oai.INVALID_REQUEST
                line = oai.error_line(custom_id if self.tasks.openai_input else row_id, code, rec["error"] or "",
                                      row_id=row_id)
            else:
                req = req or request_for(row_id, chat=self.tasks.prompts is not None and self.tasks.prompts.chat)
                logprobs = None
                if rec.get("_logprobs") is not None:
                    n = req.sampling.get("logprobs", self.spec.sampling.logprobs) or 0
                    logprobs = [_token_logprob(tokenizer, step, n) for step in rec["_logprobs"]]
                line = oai.response_line(req, text=rec["generated_text"], finish_reason=rec["finish_reason"],
                                         prompt_tokens=rec["num_prompt_tokens"],
                                         completion_tokens=rec["num_generated_tokens"],
                                         model=req.model or self.spec.model, created=created, logprobs=logprobs)
            lines.append(json.dumps(line, ensure_ascii=False))
        return pa.table({"line": pa.array(lines, pa.string())})


def output_table(spec: JobSpec, rows: list[dict], ids: list[str], records: list[dict]) -> pa.Table:
    """The output rows: id, the passed-through input columns, then the task's columns."""
    keep = spec.input.columns
    if keep is not None:  # eval needs its reference and group columns in the committed parts
        keep = set(keep) | {spec.eval.reference_column, spec.eval.group_column}
    produced = output_columns(spec)
    out = []
    for row, row_id, rec in zip(rows, ids, records):
        record = {"id": row_id}
        for name, value in row.items():
            if (keep is None or name in keep) and name not in produced and name != "id":
                record[name] = value
        record.update((k, rec.get(k)) for k in produced)
        out.append(record)
    if not out:
        return pa.table({"id": pa.array([], pa.string()),
                         **{name: pa.array([], column_type(name)) for name in produced}})
    names = list(dict.fromkeys(name for record in out for name in record))
    return pa.table({name: _column([record.get(name) for record in out], column_type(name)) for name in names})


def build_engine(config: EngineConfig):
    """The worker's engine: LLMEngine, or the instant EchoEngine for builtin:echo (scale tests)."""
    if config.model == ECHO_MODEL:
        return EchoEngine(config)
    return LLMEngine(config)


def is_out_of_memory(exc: BaseException) -> bool:
    """An allocation failure: torch.OutOfMemoryError (CUDA, MPS) or a host allocator's RuntimeError."""
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, (RuntimeError, MemoryError)) and (
        isinstance(exc, MemoryError) or any(m in str(exc) for m in OOM_MARKERS))


def _empty_device_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _cached_tokens(engine) -> int:
    """Prompt tokens the engine has served from its prefix cache so far."""
    pool = getattr(engine, "pool", None)
    return pool.hit_tokens if pool is not None else 0


def _token_logprob(tokenizer, step: dict[int, float], n: int) -> oai.TokenLogprob:
    """The engine's {token id: logprob} of one step (chosen token first, then the top n) as text."""
    (chosen, logprob), *_ = step.items()
    top = sorted(step.items(), key=lambda kv: -kv[1])[:n]
    return oai.TokenLogprob(tokenizer.decode([chosen]), logprob, [(tokenizer.decode([t]), lp) for t, lp in top])


def _share_cpu_threads(num_workers: int) -> None:
    """Ray caps a fractional-CPU actor at one math thread (OMP_NUM_THREADS=1); on a CPU-only
    node the engines should share the cores instead."""
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // num_workers))


def _column(values: list, dtype: pa.DataType | None = None) -> pa.Array:
    """An Arrow column from Python values: of `dtype` for the columns this job writes; for passed-
    through input columns, mixed types become JSON text and a column that is null in every row
    becomes text, so that the parts of one job agree."""
    if dtype is not None:
        return pa.array(values, dtype)
    try:
        array = pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        array = pa.array([v if v is None or isinstance(v, str) else json.dumps(v, default=str) for v in values],
                         pa.string())
    return array.cast(pa.string()) if pa.types.is_null(array.type) else array

