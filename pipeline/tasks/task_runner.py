"""What each task makes of a batch of rows: one RowResult per row.

generate  prompt -> text.
label     prompt -> one of `choices`, picked by the log-likelihood of each choice after the
          prompt (no sampling), generated text parsed with `label_regex`, or a JSON object
          generated under `json_schema` (its properties also in the label_fields struct).
eval      generate (or label), then score each row against its reference (`score_<metric>`
          columns); pipeline.run.reporting.metrics aggregates the committed scores into metrics.json.

Prompts come from a column, a template, chat messages (rendered with the model's chat
template) or OpenAI Batch request lines. Every problem with one row becomes that row's error; a
constrained row cut by max_tokens keeps finish_reason "length" and gets the error INCOMPLETE.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import replace
from typing import TYPE_CHECKING

from engine.api import LoRARequest, PoolingParams, SamplingParams
from engine.api import StructuredOutputsParams
from pipeline.spec import INCOMPLETE, POOLING_TASKS, row_sampling
from pipeline.tasks import scoring
from pipeline.tasks.label_fields import field_values, fields_type
from pipeline.tasks.openai_pooling import run_lines
from pipeline.tasks.openai_requests import parse_request, unknown_fields_error
from pipeline.tasks.openai_responses import output_lines
from pipeline.tasks.prompts import PromptBuilder, chat_or_error
from pipeline.tasks.row_result import RowResult

if TYPE_CHECKING:
    from engine.api import Engine
    from pipeline.spec import JobSpec

NO_MATCH = "label_regex did not match the generated text"


def row_seed(base: int, row_id: str) -> int:
    """Each row's sampling seed: the same on any worker, in any batch, on every rerun."""
    return int.from_bytes(hashlib.sha256(f"{base}\0{row_id}".encode()).digest()[:8], "big") >> 1


class TaskRunner:
    """Turns rows into RowResults (the output row's engine fields and the task's own columns)."""

    def __init__(self, spec: JobSpec, engine: Engine, prompts: PromptBuilder | None = None):
        """`prompts` builds each row's prompt; default: from the spec's input section."""
        self.spec = spec
        self.engine = engine
        self.task = spec.task
        self.openai_input = spec.input.format == "openai_batch"
        self.prompts = None if self.openai_input else prompts or PromptBuilder.from_spec(spec.input)
        sampling = spec.sampling.model_dump()
        seed = sampling.pop("seed")
        self.base_seed = spec.seed if seed is None else seed
        self.sample_rows = spec.sampling.n > 1  # one output row per sample, else one per input row
        label = spec.label
        labeling = self.task in ("label", "eval")
        self.label_schema = label.json_schema if labeling else None
        so = spec.sampling.structured_outputs
        sampling["structured_outputs"] = so.params() if so is not None else (
            StructuredOutputsParams(json=self.label_schema) if self.label_schema is not None else None)
        self.sampling = sampling
        self.sampling_column = None if self.openai_input else spec.input.sampling_column
        """Rows' own sampling fields (pipeline.spec.row_sampling), over the job's."""
        self.choices = label.choices if labeling else None
        self.choices_column = label.choices_column if labeling else None
        self.scoring = bool(self.choices or self.choices_column)
        self.label_regex = re.compile(label.label_regex) if labeling and label.label_regex else None
        self.labels = self.scoring or self.label_regex is not None or self.label_schema is not None
        self.pooling = self.task in POOLING_TASKS
        width = engine.facts().embedding_width if self.task == "embed" else None
        self.embedding_width = (spec.embed.dimensions or width) if width is not None else None
        """task embed: the embedding column's fixed width (embed.dimensions, or the model's)."""
        self.adapters = adapter_requests(spec.lora.adapters)
        """With LoRA: adapter name -> LoRARequest (the spec's adapters, lora.path's listed in)."""
        self.loras: list[LoRARequest | None] = []
        """The current batch's adapter per row (run())."""

    # -- rows -> records ------------------------------------------------------------------------

    def run(self, rows: list[dict], ids: list[str], errors: list[str | None],
            adapter: str | None = None) -> list[RowResult]:
        """One result per row, in order; `errors[i]` set = the row failed before this stage.
        `adapter`: every row runs under this adapter (a lora.each shard); else by lora.column."""
        self.loras = self._row_adapters(rows, errors, adapter)
        results = self._results(rows, ids, errors)
        if self.adapters:
            for result, lora in zip(results, self.loras):
                for r in [result] + (result.samples or []):
                    r.adapter = lora.lora_name if lora is not None else None
        return results

    def _row_adapters(self, rows: list[dict], errors: list[str | None], adapter: str | None) -> list:
        """Each row's LoRARequest (None: the base model); an unknown adapter name is the row's error."""
        if not self.adapters:
            return [None] * len(rows)
        if self.openai_input:  # body.model naming an adapter selects it (as vLLM serves them); else the base
            return [self.adapters.get(m) if isinstance(m, str) else None for m in map(_body_model, rows)]
        if adapter is not None or not self.spec.lora.column:
            return [self.adapters[adapter] if adapter else None] * len(rows)
        out = []
        for i, row in enumerate(rows):
            out.append(None)
            name = row.get(self.spec.lora.column)
            if name is None or name == "" or name == self.spec.model:  # the base model
                continue
            if name in self.adapters:
                out[-1] = self.adapters[name]
            elif errors[i] is None:
                errors[i] = f"unknown adapter {str(name)[:80]!r} (adapters: {', '.join(sorted(self.adapters))})"
        return out

    def _results(self, rows: list[dict], ids: list[str], errors: list[str | None]) -> list[RowResult]:
        results: list[RowResult | None] = [None] * len(rows)
        if self.pooling:
            self._pool(rows, errors, results)
            if self.task == "classify" and self.spec.eval.reference_column:
                self._add_scores(rows, [r or RowResult(error=e) for r, e in zip(results, errors)])
            return [r or RowResult(error=e) for r, e in zip(results, errors)]
        pooled: list[tuple[int, object]] = []  # OpenAI Batch pooling lines: (row, request)
        todo, prompts, params, requests = self.prepare(rows, ids, errors, pooled)
        if pooled:
            self._pool_lines(pooled, errors, results)
        if self.scoring:
            self._score(rows, todo, prompts, errors, results)
        else:
            completions = self.engine.generate(prompts, params, **self._loras(todo)) if prompts else []
            for i, c, sp, req in zip(todo, completions, params, requests):
                results[i] = _generated(c, sp, req, self.spec.sampling.n)
                for result in results[i].sample_results():
                    if self.label_regex is not None:
                        self._parse_label(result)
                    elif self.label_schema is not None:
                        self._parse_fields(result, self.label_schema)
        for i, result in enumerate(results):
            if result is None:
                results[i] = RowResult(error=errors[i])
        if self.task == "eval":
            self._add_scores(rows, results)
        return results

    def openai_lines(self, rows: list[dict], ids: list[str], results: list[RowResult], created: int) -> list[str]:
        """The OpenAI Batch output line of each row (JSON text); `created`: the job's creation time."""
        return output_lines(rows, ids, results, openai_input=self.openai_input,
                            chat=self.prompts is not None and self.prompts.chat, model=self.spec.model,
                            created=created, default_logprobs=self.spec.sampling.logprobs,
                            tokenizer=self.engine.tokenizer)

    def prepare(self, rows, ids, errors, pooled: list | None = None):
        """Indices of the rows that run, and their prompts (text or token ids), sampling params
        and OpenAI requests (None for other inputs); sets `errors[i]` of a row that cannot run.
        OpenAI pooling lines go to `pooled` as (row, request)."""
        refusal = self.engine.refusal("generate")
        todo, prompts, params, requests = [], [], [], []
        for i, row in enumerate(rows):
            if errors[i] is not None:
                continue
            req, overrides = None, {}
            if self.openai_input:
                req = parse_request(row)
                if req.error is None and req.unknown:
                    req.error = unknown_fields_error(req.unknown)
                if req.error is None and req.pooling is not None and pooled is not None:
                    pooled.append((i, req))
                    continue
                if req.error is None and refusal is not None:
                    req.error = f"{req.url}: {refusal}"
                if req.error is not None:
                    errors[i] = req.error
                    continue
                prompt, overrides = (req.messages if req.is_chat else req.prompt), req.sampling
            else:
                prompt, errors[i] = self.prompts.build(row)
                if prompt is None:
                    continue
            try:
                if self.sampling_column:
                    overrides = row_sampling(row.get(self.sampling_column), self.spec.sampling)
                if isinstance(prompt, list):  # chat messages (with images: an image prompt for the engine)
                    prompt = self.engine.encode_chat(prompt)
                sp = SamplingParams(**{"seed": row_seed(self.base_seed, ids[i]), **self.sampling, **overrides})
            except (ValueError, TypeError) as exc:
                errors[i] = str(exc)
                continue
            if sp.n > 1 and not self.sample_rows and self.spec.output.format != "openai_batch":
                errors[i] = ("body.n > 1 needs output.format openai_batch (one line with n choices) or sampling.n > 1 "
                             "in the job spec (one row per sample)")
                continue
            todo.append(i)
            prompts.append(prompt)
            params.append(sp)
            requests.append(req)
        return todo, prompts, params, requests

    def _loras(self, rows: list[int]) -> dict:
        """The engine's lora_request for these rows, as keyword arguments (none when LoRA is off)."""
        return {"lora_request": [self.loras[i] for i in rows]} if self.adapters else {}

    # -- embed, classify, score ------------------------------------------------------------------

    def _pool_lines(self, pooled, errors, results) -> None:
        """OpenAI Batch /v1/embeddings, /v1/score and /v1/rerank lines: each line's outputs, or its error."""
        for (i, req), (outs, error) in zip(pooled, run_lines(self.engine, [r.pooling for _, r in pooled],
                                                         self._loras([i for i, _ in pooled]).get("lora_request"))):
            if error is not None:
                errors[i] = error
                results[i] = RowResult(error=error, ran=True, request=req)
            else:
                results[i] = RowResult("", sum(o.num_prompt_tokens for o in outs), 0, "stop", None, ran=True,
                                       request=req, pooled=outs)

    def _pool(self, rows, errors, results) -> None:
        """Each row's embedding, class or pair score; a row the engine refuses keeps its error."""
        todo, inputs = [], []
        for i, row in enumerate(rows):
            if errors[i] is not None:
                continue
            if self.task == "score":
                names = (self.spec.score.text_1_column, self.spec.score.text_2_column)
                pair = [row.get(n) for n in names]
                if not all(isinstance(t, str) for t in pair):
                    errors[i] = f"score: columns {names[0]!r} and {names[1]!r} must hold text, got {pair!r}"[:300]
                    continue
                inputs.append(pair)
            else:
                prompt, errors[i] = self.prompts.build(row)
                if isinstance(prompt, list):  # chat messages (no chat turn to answer): this row's error alone
                    prompt, errors[i] = chat_or_error(self.engine, prompt)
                if prompt is None:
                    continue
                inputs.append(prompt)
            todo.append(i)
        if not todo:
            return
        loras = self._loras(todo)
        if self.task == "embed":
            outs = self.engine.embed(inputs, PoolingParams(dimensions=self.spec.embed.dimensions,
                                                           normalize=self.spec.embed.normalize), **loras)
        elif self.task == "classify":
            outs = self.engine.classify(inputs, **loras)
        else:
            outs = self.engine.score([a for a, _ in inputs], [b for _, b in inputs], **loras)
        for i, out in zip(todo, outs):
            if out.error is not None:
                errors[i] = out.error
                results[i] = RowResult(num_prompt_tokens=out.num_prompt_tokens, error=out.error, ran=True)
                continue
            result = RowResult("", out.num_prompt_tokens, 0, "stop", None, ran=True)
            if self.task == "embed":
                result.embedding = out.embedding
            elif self.task == "classify":
                result.class_label = result.label = out.label
                result.class_probs = out.probs
            else:
                result.score = out.score
            results[i] = result

    # -- label ----------------------------------------------------------------------------------

    def _score(self, rows, todo, prompts, errors, results) -> None:
        run, run_prompts, run_choices = [], [], []
        for i, prompt in zip(todo, prompts):
            choices = self.choices if self.choices else rows[i].get(self.choices_column)
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
                errors[i] = f"{self.choices_column!r} must hold a non-empty list of non-empty strings, got {choices!r}"
                continue
            prefix = self._choice_prefix(prompt)
            run.append((i, choices))
            run_prompts.append(prompt)
            run_choices.append([prefix + c for c in choices])
        scores = self.engine.score_choices(run_prompts, run_choices, **self._loras([i for i, _ in run])) if run else []
        normalize = self.spec.label.length_normalize
        for (i, choices), sc in zip(run, scores):
            if sc.error:
                errors[i] = sc.error
                continue
            per_token = [lp / n for lp, n in zip(sc.logprobs, sc.num_tokens)]
            ranking = per_token if normalize else sc.logprobs
            best = max(range(len(choices)), key=ranking.__getitem__)
            results[i] = RowResult(choices[best], sc.num_prompt_tokens, 0, "stop", None, label=choices[best],
                                   label_probs=_softmax(sc.logprobs), label_logprobs=sc.logprobs,
                                   label_logprobs_per_token=per_token, num_cached_tokens=sc.num_cached_tokens)

    def _choice_prefix(self, prompt) -> str:
        prefix = self.spec.label.choice_prefix
        if prefix is not None:
            return prefix
        # a plain prompt continues with a space ("Sentiment:" + " positive"); a chat prompt ends
        # where the assistant's answer starts
        return " " if isinstance(prompt, str) and not prompt[-1:].isspace() else ""

    def _parse_label(self, result: RowResult) -> None:
        if result.failed:
            return
        match = self.label_regex.search(result.generated_text)
        if match is None:
            result.error = NO_MATCH
            return
        result.label = match.group(1) if self.label_regex.groups else match.group(0)

    @staticmethod
    def _parse_fields(result: RowResult, schema: dict) -> None:
        """label.json_schema: the label is the generated object's JSON text, label_fields its
        properties typed for the column (a value that does not fit leaves them null, with a note)."""
        if result.failed:
            return
        try:
            obj = json.loads(result.generated_text)
        except ValueError as exc:  # the grammar makes this unreachable; never write a label that does not parse
            result.finish_reason, result.error = "error", f"the generated label is not JSON: {exc}"
            return
        result.label = result.generated_text
        try:
            result.label_fields = field_values(obj if isinstance(obj, dict) else None, fields_type(schema))
        except ValueError as exc:
            result.error = str(exc)

    # -- eval -----------------------------------------------------------------------------------

    def _add_scores(self, rows, results: list[RowResult]) -> None:
        ev = self.spec.eval
        normalize = ev.normalize.model_dump()
        # each sample row is scored on its own; a row that drew no samples is scored once (its copies share it)
        pairs = [(row, sample) for row, result in zip(rows, results) for sample in result.sample_results()]
        results = [sample for _, sample in pairs]
        refs = [row.get(ev.reference_column) for row, _ in pairs]
        failed = [r.failed for r in results]
        text_metrics = [m for m in ev.metrics if m != "accuracy"]
        columns = {}
        if text_metrics:
            preds = [None if bad else r.generated_text for r, bad in zip(results, failed)]
            columns.update(scoring.score_columns(preds, refs, text_metrics, normalize_opts=normalize,
                                                 answer_regex=ev.answer_regex))
        if "accuracy" in ev.metrics:
            # a generated label that did not parse counts as wrong, not as missing
            preds = [None if bad else (r.label or "") for r, bad in zip(results, failed)]
            columns.update(scoring.score_columns(preds, refs, ["accuracy"], normalize_opts=normalize))
        for name, values in columns.items():
            for result, value in zip(results, values):
                result.scores[name] = value


def adapter_requests(adapters: dict[str, str]) -> dict[str, LoRARequest]:
    """name -> LoRARequest; ids by sorted name, so every worker gives an adapter the same id."""
    return {name: LoRARequest(name, i + 1, adapters[name]) for i, name in enumerate(sorted(adapters))}


def _body_model(row: dict):
    """An OpenAI Batch line's body.model (what names its adapter, as vLLM serves adapters)."""
    body = row.get("body")
    return body.get("model") if isinstance(body, dict) else None


def _generated(c, sp, req, job_n: int = 1) -> RowResult:
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


def _softmax(logprobs: list[float]) -> list[float]:
    top = max(logprobs)
    exp = [math.exp(x - top) for x in logprobs]
    total = sum(exp)
    return [e / total for e in exp]
