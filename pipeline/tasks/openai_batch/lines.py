"""OpenAI Batch request lines as a task: each line's own URL and body. /v1/chat/completions and
/v1/completions lines generate (their body's sampling fields over the job's); /v1/embeddings,
/v1/score and /v1/rerank lines pool (pipeline.tasks.openai_batch.pooling). A line that does not parse,
or that the model cannot serve, fails alone."""
from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.tasks.generate import Generate
from pipeline.tasks.openai_batch.pooling import run_lines
from pipeline.tasks.openai_batch.requests import parse_request, unknown_fields_error
from pipeline.tasks.row_result import RowResult
from pipeline.tasks.task import Request, RowError

if TYPE_CHECKING:
    from pipeline.spec import Row


class OpenAIBatchLines(Generate):
    """Rows are OpenAI Batch request lines (input.format openai_batch)."""

    def prepare(self, index: int, row: Row) -> Request:
        req = parse_request(row.values)
        if req.error is None and req.unknown:
            req.error = unknown_fields_error(req.unknown)
        if req.error is not None:
            raise RowError(req.error)
        if req.pooling is not None:
            return Request(index, req.pooling, batch=req, pooled=True)
        refusal = self.engine.refusal("generate")
        if refusal is not None:
            raise RowError(f"{req.url}: {refusal}")
        return self.request(index, row, req.messages if req.is_chat else req.prompt, req.sampling, batch=req)

    def call(self, requests: list[Request]) -> list:
        """Generation lines in one engine call, pooling lines in one per kind (run_lines)."""
        pooled = [r for r in requests if r.pooled]
        answers = dict(zip(map(id, pooled), run_lines(self.engine, [r.prompt for r in pooled],
                                                       self.loras(pooled).get("lora_request")))) if pooled else {}
        generating = [r for r in requests if not r.pooled]
        if generating:
            answers.update(zip(map(id, generating), super().call(generating)))
        return [answers[id(r)] for r in requests]

    def collect(self, row: Row, request: Request, output) -> RowResult:
        if not request.pooled:
            return super().collect(row, request, output)
        outs, error = output
        if error is not None:
            return RowResult(error=error, ran=True, request=request.batch)
        return RowResult("", sum(o.num_prompt_tokens for o in outs), 0, "stop", None, ran=True,
                         request=request.batch, pooled=outs)
