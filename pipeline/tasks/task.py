"""A task's run over a batch of rows, written once for every task: each row prepared into a request
(a row that cannot run gets its error there), one engine call for the rows that run, each answer
collected into the row's result, then what the task adds over the whole batch (eval's scores).

The task classes (one per task: generate.py, choices.py, pooling.py, openai_batch/lines.py, graded.py)
say only what is their own: `prepare(index, row) -> Request`, `call(requests) -> outputs` and
`collect(row, request, output) -> RowResult`."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeline.tasks.row_result import RowResult

if TYPE_CHECKING:
    from engine.api import Engine, LoRARequest
    from pipeline.spec import Row
    from pipeline.tasks.openai_batch.requests import BatchRequest


class RowError(ValueError):
    """A problem with one row (its prompt, its choices, its request line): that row's error alone."""


@dataclass
class Request:
    """What one row asks of the engine: made by a task's prepare, answered by its call."""

    index: int
    """The row's place in the batch."""
    prompt: Any = None
    """Text, token ids or an image prompt; a pooling input; a (text_1, text_2) pair; an OpenAI pooling line."""
    params: Any = None
    """SamplingParams (generation, choice scoring) or PoolingParams."""
    choices: list[str] | None = None
    """Choice scoring: the row's labels, in order."""
    batch: BatchRequest | None = None
    """OpenAI Batch input: the request line the row holds."""
    pooled: bool = False
    """An OpenAI Batch line that pools (/v1/embeddings, /v1/score, /v1/rerank) instead of generating."""
    lora: LoRARequest | None = None
    """With LoRA: the adapter the row runs under (None: the base model)."""


class Task(ABC):
    """One task over batches of rows on one engine."""

    def __init__(self, engine: Engine, lora: bool = False):
        self.engine = engine
        self.lora = lora
        """LoRA is on: every engine call names each row's adapter."""

    def run(self, rows: list[Row], loras: list[LoRARequest | None] | None = None) -> list[RowResult]:
        """One result per row, in order; a row with an error (its own, or one found here) keeps it."""
        results: list[RowResult | None] = [None] * len(rows)
        requests = self.prepare_rows(rows, results, loras)
        if requests:
            for request, output in zip(requests, self.call(requests)):
                results[request.index] = self.collect(rows[request.index], request, output)
        return self.finish(rows, [r if r is not None else RowResult(error=row.error) for r, row in zip(results, rows)])

    def prepare_rows(self, rows: list[Row], results: list[RowResult | None] | None = None,
                     loras: list | None = None) -> list[Request]:
        """The requests of the rows that can run; the others get their error as their result."""
        requests = []
        for i, row in enumerate(rows):
            if row.error is not None:
                continue
            try:
                request = self.prepare(i, row)
            except (ValueError, TypeError) as exc:  # the row's own fault (RowError among them)
                if results is not None:
                    results[i] = RowResult(error=str(exc))
                continue
            request.lora = loras[i] if loras else None
            requests.append(request)
        return requests

    @abstractmethod
    def prepare(self, index: int, row: Row) -> Request:
        """The row's request; RowError (or a ValueError of the engine's checks) says why it cannot run."""

    @abstractmethod
    def call(self, requests: list[Request]) -> list:
        """The engine's answer to each request, in order."""

    @abstractmethod
    def collect(self, row: Row, request: Request, output) -> RowResult:
        """The row's result from the engine's answer."""

    def finish(self, rows: list[Row], results: list[RowResult]) -> list[RowResult]:
        """What the task adds once every row has its result (nothing, unless the task scores)."""
        return results

    def loras(self, requests: list[Request]) -> dict:
        """The engine's lora_request for these requests, as keyword arguments (none when LoRA is off)."""
        return {"lora_request": [r.lora for r in requests]} if self.lora else {}
