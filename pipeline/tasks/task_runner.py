"""What each task makes of a batch of rows: one RowResult per row, by the task's own class.

generate  prompt -> text (pipeline.tasks.generate.Generate).
label     prompt -> one of `choices`, picked by the log-likelihood of each choice after the prompt
          (choices.LabelByChoices); generated text parsed with `label_regex` (generate.LabelByParsing);
          or a JSON object generated under `json_schema` (generate.LabelByFields).
eval      generate (or label), then each row graded against its reference (scored.Graded).
embed, classify, score   pooling (pooling.Embed, Classify, Score; classify with a reference is scored).
OpenAI Batch request lines: each line's own URL and body (openai_batch.lines.OpenAIBatchLines).

The runner picks the class once, gives each row its LoRA adapter, and runs the class over each batch;
every problem with one row becomes that row's error (pipeline.tasks.task.Task.run).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.api import LoRARequest
from pipeline.spec import POOLING_TASKS, Stage
from pipeline.tasks.choices import LabelByChoices
from pipeline.tasks.generate import Generate, LabelByFields, LabelByParsing
from pipeline.tasks.openai_batch.lines import OpenAIBatchLines
from pipeline.tasks.openai_batch.responses import output_lines
from pipeline.tasks.pooling import Classify, Embed, Score
from pipeline.tasks.prompts import PromptBuilder
from pipeline.tasks.row_result import RowResult
from pipeline.tasks.graded import Graded

if TYPE_CHECKING:
    from engine.api import Engine
    from pipeline.spec import JobSpec, Row
    from pipeline.tasks.task import Request, Task

POOLING_CLASSES = {"embed": Embed, "classify": Classify, "score": Score}


def task_for(stage: Stage, engine: Engine, prompts: PromptBuilder | None, lora: bool) -> Task:
    """The task class of `stage`, on `engine`."""
    spec = stage.spec
    if spec.task in POOLING_TASKS:
        task = POOLING_CLASSES[spec.task](spec, engine, prompts, lora=lora)
        return Graded(spec, task) if spec.task == "classify" and spec.eval.reference_column else task
    if stage.requests:
        return OpenAIBatchLines(spec, engine, None, lora=lora, lines=stage.lines)
    label, kind = spec.label, Generate  # generate, and eval of plain generations
    if spec.task in ("label", "eval"):
        if label.choices or label.choices_column:
            kind = LabelByChoices
        elif label.label_regex:
            kind = LabelByParsing
        elif label.json_schema is not None:
            kind = LabelByFields
    task = kind(spec, engine, prompts, lora=lora, sampling_column=stage.sampling_column, lines=stage.lines)
    return Graded(spec, task) if spec.task == "eval" else task


class TaskRunner:
    """Turns rows into RowResults (the output row's engine fields and the task's own columns)."""

    def __init__(self, stage: Stage | JobSpec, engine: Engine, prompts: PromptBuilder | None = None):
        """`stage`: a Stage, or a job's spec (its stage); `prompts` builds each row's prompt (default:
        from the stage's prompt fields, a job's input section)."""
        self.stage = stage = Stage.of(stage)
        self.spec = spec = stage.spec
        self.engine = engine
        self.prompts = (None if stage.requests or spec.task == "score"
                        else prompts or PromptBuilder.from_spec(stage.prompts))
        self.adapters = adapter_requests(spec.lora.adapters)
        """With LoRA: adapter name -> LoRARequest (the spec's adapters, lora.path's listed in)."""
        self.task = task_for(stage, engine, self.prompts, bool(self.adapters))
        inner = self.task.inner if isinstance(self.task, Graded) else self.task
        self.by_choices = isinstance(inner, LabelByChoices)
        """Labels by choice scoring: no token is generated."""
        width = engine.facts().embedding_width if spec.task == "embed" else None
        self.embedding_width = (spec.embed.dimensions or width) if width is not None else None
        """task embed: the embedding column's fixed width (embed.dimensions, or the model's)."""

    def run(self, rows: list[Row], adapter: str | None = None) -> list[RowResult]:
        """One result per row, in order; a row with an error (set before this stage) keeps it.
        `adapter`: every row runs under this adapter (a lora.each shard); else by lora.column."""
        rows, loras = self._row_adapters(rows, adapter)
        results = self.task.run(rows, loras if self.adapters else None)
        if self.adapters:
            for result, lora in zip(results, loras):
                for r in [result] + (result.samples or []):
                    r.adapter = lora.lora_name if lora is not None else None
        return results

    def requests(self, rows: list[Row]) -> list[Request]:
        """The requests of the rows that can run, as the task prepares them (`batchinfer tune`)."""
        return self.task.prepare_rows(rows)

    def openai_lines(self, rows: list[Row], results: list[RowResult], created: int) -> list[str]:
        """The OpenAI Batch output line of each row (JSON text); `created`: the job's creation time."""
        return output_lines([r.values for r in rows], [r.id for r in rows], results,
                            openai_input=self.stage.requests,
                            chat=self.prompts is not None and self.prompts.chat, model=self.spec.model,
                            created=created, default_logprobs=self.spec.sampling.logprobs,
                            tokenizer=self.engine.tokenizer)

    def _row_adapters(self, rows: list[Row], adapter: str | None) -> tuple[list[Row], list]:
        """Each row's LoRARequest (None: the base model); an unknown adapter name is the row's error."""
        if not self.adapters:
            return rows, [None] * len(rows)
        if self.stage.requests:  # body.model naming an adapter selects it (as vLLM serves them)
            return rows, [self.adapters.get(m) if isinstance(m, str) else None for m in map(_body_model, rows)]
        if adapter is not None or not self.spec.lora.column:
            return rows, [self.adapters[adapter] if adapter else None] * len(rows)
        out, loras = [], []
        for row in rows:
            name = row.get(self.spec.lora.column)
            lora = None
            if name is not None and name != "" and name != self.spec.model:  # else the base model
                lora = self.adapters.get(name)
                if lora is None:
                    row = row.failing(f"unknown adapter {str(name)[:80]!r} (adapters: {', '.join(sorted(self.adapters))})")
            out.append(row)
            loras.append(lora)
        return out, loras


def adapter_requests(adapters: dict[str, str]) -> dict[str, LoRARequest]:
    """name -> LoRARequest; ids by sorted name, so every worker gives an adapter the same id."""
    return {name: LoRARequest(name, i + 1, adapters[name]) for i, name in enumerate(sorted(adapters))}


def _body_model(row: Row):
    """An OpenAI Batch line's body.model (what names its adapter, as vLLM serves adapters)."""
    body = row.get("body")
    return body.get("model") if isinstance(body, dict) else None
