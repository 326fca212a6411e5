"""Generation tasks: a prompt per row -> generated text (generate), and labels taken from it: parsed
with `label_regex` (label by parsing) or generated as a JSON object under `label.json_schema` (label by
fields, its properties also in the label_fields struct). A constrained row cut by max_tokens keeps
finish_reason "length" and gets the error INCOMPLETE."""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import replace
from typing import TYPE_CHECKING

from engine.api import SamplingParams, StructuredOutputsParams
from pipeline.spec import INCOMPLETE, row_sampling
from pipeline.tasks.label_fields import field_values, fields_type
from pipeline.tasks.row_result import RowResult
from pipeline.tasks.task import Request, RowError, Task

if TYPE_CHECKING:
    from engine.api import Engine
    from pipeline.spec import JobSpec, Row
    from pipeline.tasks.openai_batch.requests import BatchRequest
    from pipeline.tasks.prompts import PromptBuilder

NO_MATCH = "label_regex did not match the generated text"
N_NEEDS_ROWS = ("body.n > 1 needs output.format openai_batch (one line with n choices) or sampling.n > 1 in the job "
                "spec (one row per sample)")


def row_seed(base: int, row_id: str) -> int:
    """Each row's sampling seed: the same on any worker, in any batch, on every rerun."""
    return int.from_bytes(hashlib.sha256(f"{base}\0{row_id}".encode()).digest()[:8], "big") >> 1


class Generate(Task):
    """task generate: each row's prompt (a column, a template, chat messages) and sampling -> text."""

    def __init__(self, spec: JobSpec, engine: Engine, prompts: PromptBuilder | None, lora: bool = False,
                 sampling_column: str | None = None, lines: bool = False):
        super().__init__(engine, lora)
        self.prompts = prompts
        sampling = spec.sampling.model_dump()
        seed = sampling.pop("seed")
        self.base_seed = spec.seed if seed is None else seed
        labeling = spec.task in ("label", "eval")
        schema = spec.label.json_schema if labeling else None
        so = spec.sampling.structured_outputs
        sampling["structured_outputs"] = so.params() if so is not None else (
            StructuredOutputsParams(json=schema) if schema is not None else None)
        self.sampling = sampling
        self.spec_sampling = spec.sampling
        self.n = spec.sampling.n
        self.sampling_column = sampling_column
        """Rows' own sampling fields (pipeline.spec.row_sampling), over the job's."""
        self.lines = lines
        """Results become OpenAI Batch lines: a request of n samples is one line with n choices."""

    def prepare(self, index: int, row: Row) -> Request:
        prompt, error = self.prompts.build(row.values)
        if prompt is None:
            raise RowError(error)
        return self.request(index, row, prompt)

    def request(self, index: int, row: Row, prompt, overrides: dict | None = None,
                batch: BatchRequest | None = None) -> Request:
        """A generation request: chat messages rendered by the engine, the row's seed and sampling."""
        overrides = overrides or {}
        if self.sampling_column:
            overrides = row_sampling(row.get(self.sampling_column), self.spec_sampling)
        if isinstance(prompt, list):  # chat messages (with images: an image prompt for the engine)
            prompt = self.engine.encode_chat(prompt)
        params = SamplingParams(**{"seed": row_seed(self.base_seed, row.id), **self.sampling, **overrides})
        if params.n > 1 and self.n == 1 and not self.lines:
            raise RowError(N_NEEDS_ROWS)
        return Request(index, prompt, params, batch=batch)

    def call(self, requests: list[Request]) -> list:
        return self.engine.generate([r.prompt for r in requests], [r.params for r in requests], **self.loras(requests))

    def collect(self, row: Row, request: Request, completion) -> RowResult:
        result = generated(completion, request.params, request.batch, self.n)
        for sample in result.sample_results():
            if not sample.failed:
                self.parse(sample)
        return result

    def parse(self, result: RowResult) -> None:
        """What a label task takes from a generated text (nothing for generate)."""


class LabelByParsing(Generate):
    """task label with label_regex: generate, then the label is the regex's first group (or whole match)."""

    def __init__(self, spec: JobSpec, engine: Engine, prompts, **kwargs):
        super().__init__(spec, engine, prompts, **kwargs)
        self.label_regex = re.compile(spec.label.label_regex)

    def parse(self, result: RowResult) -> None:
        match = self.label_regex.search(result.generated_text)
        if match is None:
            result.error = NO_MATCH
            return
        result.label = match.group(1) if self.label_regex.groups else match.group(0)


class LabelByFields(Generate):
    """task label with label.json_schema: the label is the generated object's JSON text, label_fields its
    properties typed for the column (a value that does not fit leaves them null, with a note)."""

    def __init__(self, spec: JobSpec, engine: Engine, prompts, **kwargs):
        super().__init__(spec, engine, prompts, **kwargs)
        self.schema = spec.label.json_schema

    def parse(self, result: RowResult) -> None:
        try:
            obj = json.loads(result.generated_text)
        except ValueError as exc:  # the grammar makes this unreachable; never write a label that does not parse
            result.finish_reason, result.error = "error", f"the generated label is not JSON: {exc}"
            return
        result.label = result.generated_text
        try:
            result.label_fields = field_values(obj if isinstance(obj, dict) else None, fields_type(self.schema))
        except ValueError as exc:
            result.error = str(exc)


def generated(c, sp, req, job_n: int = 1) -> RowResult:
    """The result of a completion; with n > 1, one result per sample (a request that failed before
    it drew samples, or an engine that returns none, gives n copies of its one result). In a job
    of `job_n` > 1 samples, an OpenAI Batch request asking for one gets one sample, not copies
    of it labelled as others. A constrained row cut at max_tokens is an error: its structure
    never closed."""
    # a constraint that did not compile is the request's fault: the engine never ran it
    ran = not (c.finish_reason == "error" and (c.error or "").startswith("structured_outputs"))

    def one(text, tokens, finish_reason, error, logprobs, index=0, cached=c.num_cached_tokens) -> RowResult:
        result = RowResult(text, c.num_prompt_tokens, tokens, finish_reason, error, sample_index=index, ran=ran,
                           request=req, logprobs=logprobs, num_cached_tokens=cached)
        if sp.structured_outputs is not None and finish_reason == "length":
            result.error = INCOMPLETE
        return result

    result = one(c.text, c.num_generated_tokens, c.finish_reason, c.error, c.logprobs)
    result.prompt_logprobs = c.prompt_logprobs
    if sp.n == 1:
        if job_n > 1:
            result.samples = [replace(result)]  # its one sample: the only row it writes
        return result
    if len(c.samples) == sp.n:
        result.samples = [replace(one(s.text, s.num_generated_tokens, s.finish_reason, s.error, s.logprobs, s.index,
                                      s.num_cached_tokens), prompt_logprobs=result.prompt_logprobs) for s in c.samples]
    else:
        result.samples = result.sample_results(sp.n)
    return result
