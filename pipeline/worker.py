"""Generate stage: an actor holding one engine, turning whole shards into committed parts."""
from __future__ import annotations

import json
import os
import socket
import time

import pyarrow as pa

from engine import EngineConfig, LLMEngine
from engine.loader import one_line
from pipeline import chaos
from pipeline import openai_batch as oai
from pipeline.sink import SUMMARY_FIELDS, OutputDir, summarize
from pipeline.source import Shard, read_shard
from pipeline.storage import Storage, with_retries
from pipeline.tasks import TaskRunner, column_type, output_columns, request_for


class FatalShardError(RuntimeError):
    """A shard that can never succeed (e.g. duplicate ids): the job must stop."""


def engine_config(spec: dict) -> EngineConfig:
    return EngineConfig(model=spec["model"], seed=spec["seed"], **spec["engine"])


class EngineActor:
    """A Ray Data actor holding one engine. A constructor that raises makes Ray restart the actor
    again and again; a failed setup is instead reported by the first call (`check_setup`), which
    fails the job or the dataset with this one line."""

    def __init__(self, spec: dict):
        self.setup_error = None
        try:
            self._setup(spec)
        except Exception as exc:  # noqa: BLE001
            self.setup_error = f"worker setup failed on {socket.gethostname()}: {one_line(exc)}"

    def _setup(self, spec: dict) -> None:
        raise NotImplementedError

    def check_setup(self) -> None:
        if self.setup_error:
            raise FatalShardError(self.setup_error)


def start_engine(spec: dict, prompts=None) -> tuple[LLMEngine, TaskRunner]:
    """The engine for `spec` (its CPU threads shared among the node's actors) and its task runner."""
    if not spec["workers"]["gpus"]:
        _share_cpu_threads(spec["workers"]["num"])
    engine = LLMEngine(engine_config(spec))
    return engine, TaskRunner(spec, engine, prompts)


class ShardWorker(EngineActor):
    """Ray Data actor: `__call__` takes a batch of shard descriptors, reads each shard, runs the
    engine on its rows, and commits one output part per shard. Returns one summary per shard."""

    def _setup(self, spec: dict) -> None:
        chaos.point("init")
        self.spec = spec
        self.input = Storage(spec["input"]["path"], spec["input"]["storage_options"])
        self.output = OutputDir(Storage(spec["output"]["path"], spec["output"]["storage_options"]),
                                spec["output"]["format"])
        self.engine, self.tasks = start_engine(spec)
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}"

    def __call__(self, batch: dict) -> dict:
        self.check_setup()
        results = [self.process(shard) for shard in Shard.from_batch(batch)]
        return {k: [r[k] for r in results] for k in results[0]}

    def process(self, shard: Shard) -> dict:
        started = time.perf_counter()
        rows, ids, errors = with_retries(lambda: read_shard(self.input, shard), f"reading {shard.name}")
        rows, ids, errors, skipped = self._bad_lines(rows, ids, errors)
        ids = self._ids(rows, ids, errors)
        records = self.tasks.run(rows, ids, errors)
        table = output_table(self.spec, rows, ids, records)
        summary = summarize(table)
        if self.output.format == "openai_batch":
            table = self._openai_lines(rows, ids, records)
        summary.update(skipped=skipped, shard=shard.key, file=shard.name, start=shard.start, stop=shard.stop,
                       seconds=time.perf_counter() - started, worker=self.worker_id,
                       part=self.output.storage.uri(self.output.part_path(shard.key)))
        chaos.point("shard")
        with_retries(lambda: self.output.commit(shard.key, table, summary), f"committing shard {shard.key}")
        return {k: summary[k] for k in ("shard", *SUMMARY_FIELDS, "seconds", "worker", "part", "error_samples")}

    def _bad_lines(self, rows, ids, errors):
        """Applies input.on_bad_line to lines that did not parse: error (keep as error rows),
        skip (leave out, counted), fail (stop the job naming the line)."""
        policy = self.spec["input"]["on_bad_line"]
        bad = [i for i, e in enumerate(errors) if e is not None]
        if not bad or policy == "error":
            return rows, ids, errors, 0
        if policy == "fail":
            raise FatalShardError(errors[bad[0]])
        keep = [i for i, e in enumerate(errors) if e is None]
        return [rows[i] for i in keep], [ids[i] for i in keep], [None] * len(keep), len(bad)

    def _ids(self, rows: list[dict], derived: list[str], errors: list) -> list[str]:
        column = self.spec["input"]["id_column"]
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
        created, lines = self.spec.get("created") or int(time.time()), []
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
                    n = req.sampling.get("logprobs", self.spec["sampling"]["logprobs"]) or 0
                    logprobs = [_token_logprob(tokenizer, step, n) for step in rec["_logprobs"]]
                line = oai.response_line(req, text=rec["generated_text"], finish_reason=rec["finish_reason"],
                                         prompt_tokens=rec["num_prompt_tokens"],
                                         completion_tokens=rec["num_generated_tokens"],
                                         model=req.model or self.spec["model"], created=created, logprobs=logprobs)
            lines.append(json.dumps(line, ensure_ascii=False))
        return pa.table({"line": pa.array(lines, pa.string())})


def output_table(spec: dict, rows: list[dict], ids: list[str], records: list[dict]) -> pa.Table:
    """The output rows: id, the passed-through input columns, then the task's columns."""
    keep = spec["input"]["columns"]
    if keep is not None:  # eval needs its reference and group columns in the committed parts
        keep = set(keep) | {spec["eval"]["reference_column"], spec["eval"]["group_column"]}
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

