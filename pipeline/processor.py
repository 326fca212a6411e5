"""A Ray Data processor: the job's generate/label/eval stage applied to any `ray.data.Dataset`.

    processor = build_processor({"model": "builtin:tiny", "sampling": {"max_tokens": 32}},
                                preprocess=lambda row: {"prompt": row["question"]},
                                postprocess=lambda row: {"answer": row["generated_text"]})
    ds = processor(ray.data.read_parquet("s3://bucket/questions/"))

preprocess -> engine actors (the job's own EngineActor and TaskRunner) -> postprocess. The output
rows carry the columns of a job's parts. Exactly-once resume is the job runner's (`batchinfer
run`): a processor is a lazy Dataset transformation with no commit records.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Callable

import pyarrow as pa

from pipeline.errors import SpecError
from pipeline.io import read_schema_files
from pipeline.run import EngineActor, engine_stage_args, listed_adapters
from pipeline.run.shards.devices import picks_devices, resolve_devices
from pipeline.spec import SAMPLING_PARAMS, ProcessorSpec, Row, Stage, validate
from pipeline.tasks import PromptBuilder, output_table, start_engine

log = logging.getLogger(__name__)

SECTIONS = tuple(ProcessorSpec.model_fields)
"""The keys a processor takes: a stage's (pipeline.spec.StageSpec) and workers."""


def build_processor(config: dict, preprocess: Callable[[dict], dict] | None = None,
                    postprocess: Callable[[dict], dict] | None = None) -> "Processor":
    """A callable mapping a Dataset to a Dataset of generated rows. `config` holds the job spec's
    sections but input/output, validated by the job spec's rules (SpecError names a bad key).
    `preprocess` maps a row to a row with a `prompt` (text) or `messages` (chat, rendered with the
    model's chat template), and optionally `sampling_params` (a dict of sampling fields over the
    config's `sampling` for that row; a bad one is that row's error); `postprocess` maps each output row to the row returned. Nothing is
    loaded or started until the returned Dataset executes."""
    unknown = [key for key in config if key not in SECTIONS]
    if unknown:
        raise SpecError(f"{unknown[0]}: not a processor setting (a processor takes {', '.join(SECTIONS)}; "
                        "the Dataset is its input and its result)")
    lora = config.get("lora")
    if isinstance(lora, dict) and (lora.get("adapters") or lora.get("path")) and not lora.get("each"):
        config = {**config, "lora": {"column": "model", **lora}}  # a row's `model` names its adapter (Ray Data LLM)
    spec = listed_adapters(read_schema_files(validate(config, ProcessorSpec)))  # lora.path listed once, here
    return Processor(spec, preprocess, postprocess)


@dataclass(frozen=True)
class Processor:
    """preprocess -> generate (one engine per actor, `workers.num` actors) -> postprocess."""

    spec: ProcessorSpec
    """The validated stage and workers."""
    preprocess: Callable[[dict], dict] | None = None
    """Row -> row with `prompt` or `messages`."""
    postprocess: Callable[[dict], dict] | None = None
    """Output row -> the row returned."""

    def __call__(self, ds):
        spec = self.spec
        if picks_devices(spec):  # engine.device auto: GPUs where the cluster has them, one per rank
            import ray

            spec = spec.model_copy(deep=True)
            if ray.is_initialized():
                log.info(resolve_devices(spec).line)
        workers = spec.workers
        if self.preprocess is not None:
            ds = ds.map(self.preprocess)
        ds = ds.map_batches(RowWorker, fn_constructor_kwargs={"spec": spec}, batch_format="pyarrow",
                            batch_size=workers.rows_per_batch, **engine_stage_args(workers))
        if self.postprocess is not None:
            ds = ds.map(self.postprocess)
        return ds


class RowWorker(EngineActor):
    """Ray Data actor: a batch of preprocessed rows in, the same rows with the task's columns out."""

    def _setup(self, spec: ProcessorSpec) -> None:
        self.spec = spec
        # a row's sampling_params (from preprocess) override the sampling section for that row (Ray Data LLM)
        self.stage = Stage(spec, sampling_column=SAMPLING_PARAMS)
        self.engine, self.tasks = start_engine(self.stage, spec.workers, RowPrompts())

    def __call__(self, batch: pa.Table) -> pa.Table:
        self.check_setup()
        return self.on_engine_thread(self._rows, batch)

    def _rows(self, batch: pa.Table) -> pa.Table:
        rows = [Row(row_id(values), values) for values in batch.to_pylist()]
        if not self.spec.lora.each:
            return output_table(self.stage, rows, self.tasks.run(rows), self.tasks.embedding_width)
        # every row under every adapter (and the base model with include_base)
        tables = [output_table(self.stage, rows, self.tasks.run(rows, name), self.tasks.embedding_width)
                  for name in self.spec.lora.each_adapters]
        return pa.concat_tables(tables)


class RowPrompts(PromptBuilder):
    """A row's prompt: its `messages` when set (chat template), else its `prompt`."""

    def __init__(self):
        super().__init__(prompt_column="prompt")
        self.messages = PromptBuilder(prompt_column=None, messages_column="messages")

    def build(self, row: dict):
        if row.get("messages") is not None:
            return self.messages.build(row)
        if "prompt" not in row:
            return None, "row has no 'prompt' or 'messages' (preprocess must return one of them)"
        return super().build(row)


def row_id(row: dict) -> str:
    """The row's `id`, else a hash of its prompt: it seeds the row's sampling, so a prompt samples
    the same tokens on every run and in any batch."""
    if row.get("id") is not None:
        return str(row["id"])
    content = row.get("messages") if row.get("messages") is not None else row.get("prompt")
    return hashlib.sha256(json.dumps(content, sort_keys=True, default=str).encode()).hexdigest()[:16]
