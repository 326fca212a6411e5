"""The records an output directory keeps besides its parts: a shard's commit record and a run's record.

Both are JSON on storage. They are read back by later versions, so a field is only ever added,
with a default, and `from_dict` fills what an older record lacks and ignores what it does not know.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pyarrow as pa

from pipeline.spec import is_failed

if TYPE_CHECKING:
    from pipeline.spec import WorkersSpec



def _known(cls, data: dict) -> dict:
    """The fields of `cls` that `data` holds; a null where the field has a default of another kind
    is left out, so the default applies."""
    out = {}
    for f in dataclasses.fields(cls):
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        if f.name in data and not (data[f.name] is None and has_default and f.default is not None):
            out[f.name] = data[f.name]
    return out


@dataclass(kw_only=True)
class Counts:
    """The counts kept per shard and summed per run and per job."""

    rows: int = 0
    """Output rows (with sampling.n > 1, one per sample; OpenAI Batch output: one per line)."""
    errors: int = 0
    """Rows that failed: finish_reason "error", or a structured output cut by max_tokens."""
    skipped: int = 0
    """Malformed lines left out (input.on_bad_line: skip)."""
    prompt_tokens: int = 0
    """Prompt tokens over the rows (with n > 1 samples, every sample row's: each reads the prompt, whose
    shared blocks count as prefix-cache hits)."""
    generated_tokens: int = 0
    """Generated tokens over the rows."""
    cached_prompt_tokens: int = 0
    """Prompt tokens served by the engine's prefix cache (0 in records written before it was counted)."""

    def add(self, other: Counts) -> None:
        for k in SUMMARY_FIELDS:
            setattr(self, k, getattr(self, k) + int(getattr(other, k)))

    def counts(self) -> dict:
        return {k: getattr(self, k) for k in SUMMARY_FIELDS}


SUMMARY_FIELDS = tuple(f.name for f in dataclasses.fields(Counts))
"""Counts kept per shard and summed per run and per job."""


@dataclass(kw_only=True)
class CommitRecord(Counts):
    """One committed shard: which part it is, what it holds and what it cost (its Counts are
    over the part's rows). Written to `_progress/<shard>.json` with the part, and one line of the
    part index."""

    shard: str = ""
    """The shard's key: its part is data/part-<shard>.<ext>."""
    path: str = ""
    """The part's URL."""
    file: str = ""
    """The input file, relative to the input root."""
    start: int = 0
    """First row (JSONL: line) of the file in the shard, 0-based."""
    stop: int = 0
    """One past the shard's last row."""
    bytes: int = 0
    """Input bytes the shard covers (Parquet: its rows' share of the file); progress is measured in them."""
    error_samples: list[str] = field(default_factory=list)
    """The first few error messages of the part."""
    worker: str | None = None
    """host:pid of the actor that ran the shard."""
    read_seconds: float = 0.0
    """Reading the shard's input."""
    engine_seconds: float = 0.0
    """The task's engine work."""
    commit_seconds: float = 0.0
    """Writing the part and this record (0 in the record on storage, which is written before it is known)."""
    idle_seconds: float = 0.0
    """The actor's wait since its previous shard (Ray Data's hand-over)."""
    seconds: float = 0.0
    """The shard in all, from its read to its commit."""
    committed_at: float | None = None
    """Unix time of the commit."""
    oom_retries: int = 0
    """Times the shard was retried at half the engine's budget after running out of memory."""
    oom_budgets: list[int] = field(default_factory=list)
    """The max_batch_tokens budgets those retries ran at."""
    max_batch_tokens: int | None = None
    """The engine budget the part was generated at."""
    engine: dict | None = None
    """The engine that generated the part (engine.api.EngineFacts.record(): RECORD_FIELDS): resolved device, dtype
    and quantization, weights' bytes, KV pool blocks and bytes, max_num_batched_tokens; and `gguf`
    (file, digest, tensor types: engine.api.protocol.GGUF_FIELDS) for a model read from a GGUF file."""

    @classmethod
    def from_dict(cls, data: dict) -> CommitRecord:
        return cls(**_known(cls, data))

    @classmethod
    def from_json(cls, text: str) -> CommitRecord:
        return cls.from_dict(json.loads(text))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), default=str)

    @classmethod
    def counted(cls, table: pa.Table) -> CommitRecord:
        """A record of the counts over an output table of rows (identity and times left unset; an
        OpenAI Batch part of lines is counted by pipeline.io.formats.openai_batch)."""
        d = table.select(["finish_reason", "error", "num_prompt_tokens", "num_generated_tokens"]).to_pydict()
        errors = [e for e, r in zip(d["error"], d["finish_reason"]) if is_failed(r, e)]
        return cls(rows=table.num_rows, errors=len(errors), prompt_tokens=int(sum(d["num_prompt_tokens"])),
                   generated_tokens=int(sum(d["num_generated_tokens"])), error_samples=errors[:3])


@dataclass(kw_only=True)
class RunRecord(Counts):
    """One run of a job (a resumed job has several), kept under `_runs/<run_id>.json` while it goes
    (rewritten on every lock heartbeat), for the job's usage and cost. Its Counts are those of the
    shards this run committed."""

    run_id: str
    """Start time and a random suffix, e.g. 20261130T020000-3fa2c1."""
    started: float
    """Unix time the run started."""
    last_seen: float
    """Unix time the run was last known alive: a crashed run counts up to here."""
    finished: float | None = None
    """Unix time the run ended; None while it runs (or after a crash)."""
    status: str = "running"
    """running | done | failed"""
    generate_started: float | None = None
    """Unix time the shards started running (after Ray's start and the checks)."""
    generate_seconds: float = 0.0
    """Wall time of the shards so far."""
    workers: int = 1
    """Engine actors the run started: workers.num, or fewer when the input has fewer planning tasks."""
    resource: str = "cpu_core"
    """What an actor's time is counted in: gpu, or cpu_core."""
    resource_per_actor: float = 1
    """GPUs per actor, or the CPU cores its engine's threads use."""
    planning: dict | None = None
    """Sums of the planning records (tasks, files, shards, rows, seconds), once the run is done."""

    @classmethod
    def start(cls, workers: WorkersSpec, run_id: str) -> RunRecord:
        """The record of a run starting now with these workers."""
        now = time.time()
        run = cls(run_id=run_id, started=now, last_seen=now, workers=workers.num, resource="cpu_core",
                  resource_per_actor=1)
        run.set_workers(workers)
        return run

    def set_workers(self, workers: WorkersSpec) -> None:
        """The resources of its actors once they are known (batchinfer may pick GPUs after start)."""
        self.resource = "gpu" if workers.gpus else "cpu_core"
        self.resource_per_actor = workers.gpus or max(1, (os.cpu_count() or 1) // workers.num)

    def start_generating(self) -> None:
        self.generate_started = time.time()

    def touch(self) -> None:
        """Brings the clock fields up to now (while the run is still going)."""
        if self.finished is not None:
            return
        now = time.time()
        self.last_seen = now
        if self.generate_started is not None:
            self.generate_seconds = now - self.generate_started

    def end(self, status: str) -> None:
        self.touch()
        self.status, self.finished = status, time.time()

    @classmethod
    def from_dict(cls, data: dict) -> RunRecord:
        return cls(**_known(cls, data))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


JOB_RECORD = "_job.json"
"""Where an output keeps its JobRecord."""


@dataclass(kw_only=True, frozen=True)
class JobRecord:
    """What an output directory remembers of the job that owns it (`_job.json`): written when the
    output starts, added to as a run learns more, read by every rerun to decide whether it resumes
    this output and how. Frozen: the output's owner (pipeline.io.output.OutputDir: `open_record`,
    `change_record`) is the one place it changes and is saved. Later versions read it, so a field is
    only ever added; keys this version does not know are kept as read and written back (`unknown`).
    A record of an earlier version is read into today's fields once, when the output is opened
    (pipeline.io.earlier)."""

    fingerprint: str | None = None
    """The spec's fingerprint (JobSpec.fingerprint()): a rerun with another is refused, unless it
    only differs in what stopped counting (pipeline.spec.fingerprint), when it is re-recorded."""
    created: float | None = None
    """Unix time the output started; OpenAI Batch output lines carry it, the same on every resume."""
    shard_plan: str | None = None
    """How the input is cut into shards: "segments" (JSONL files over segment_bytes planned in
    segments), "bytes" (whole files, shards ended by bytes), "rows" (whole files, shards of
    workers.rows_per_batch rows, 256 by default: read so from a record of before shard_bytes, which
    has none)."""
    segment_bytes: int | None = None
    """With shard_plan "segments": the segment size."""
    numerics: dict | None = None
    """{"dtype", "device"} the output computes in (JobSpec.numerics()): a resume must compute alike.
    Read as {"device"} alone from a record of before numerics whose output has parts."""
    spec: dict | None = None
    """The spec the output started with, as JSON with its fingerprint, secrets redacted: its
    rows_per_batch and shard_bytes keep cutting the same shards on every resume."""
    adapters: dict | None = None
    """LoRA: adapter name -> digest of its files (pipeline.run.checks.adapters): an adapter whose files
    changed is refused, one added to a lora.each job computes only its rows."""
    plan_blocks: int | None = None
    """Planning tasks of the latest run (each writes a record under _plan/)."""
    ids_unique: bool | None = None
    """True once input.id_column's values were checked unique: resumes skip the check."""
    ids_duplicate: dict | None = None
    """The duplicate id the check found (pipeline.run.shards.unique_ids.Duplicate.to_json: the id, its
    two places, the error line): a rerun refuses in that line while both places still hold it."""
    batchinfer_version: str | None = None
    """The batchinfer that started the output."""
    model_identity: dict | None = None
    """What identifies the model's weights ({"kind", "id"}: engine.models.identity): a resume whose
    model changed (a moved Hub revision, rewritten files) is refused."""
    inputs: dict | None = None
    """The input files it started on ({files, digest, sizes}: pipeline.run.checks.inputs): a resume
    whose files changed or went is refused; files added since are recorded."""
    shards_planned: int | None = None
    """Layout 1 only (no plan_blocks): the shards its driver planned."""
    unknown: dict = field(default_factory=dict)
    """Keys of a newer batchinfer's record, kept as read."""
    filled: frozenset = field(default=frozenset(), compare=False)
    """Fields read into today's shape from an earlier version's record (pipeline.io.earlier): not
    written back until a run sets them, so the record on storage keeps lacking what it lacked."""

    @classmethod
    def from_dict(cls, data: dict) -> JobRecord:
        names = {f.name for f in dataclasses.fields(cls)} - {"unknown", "filled"}
        return cls(**{k: v for k, v in data.items() if k in names},
                   unknown={k: v for k, v in data.items() if k not in names})

    def to_dict(self) -> dict:
        """The fields set (a record of an earlier version keeps lacking what it lacked), then `unknown`."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("unknown", "filled") and f.name not in self.filled
               and getattr(self, f.name) is not None}
        return out | self.unknown

    def changed(self, **changes) -> JobRecord:
        """This record with `changes` set (they are no longer read from an earlier shape)."""
        return dataclasses.replace(self, **changes, filled=self.filled - changes.keys())
