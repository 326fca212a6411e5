"""Pooling tasks: a row's text -> its embedding (embed), its class and probabilities (classify), or
a text pair -> its score (score). No token is generated; a row the engine refuses keeps its error."""
from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING

from engine.api import PoolingParams
from pipeline.tasks.prompts import chat_or_error
from pipeline.tasks.row_result import RowResult
from pipeline.tasks.task import Request, RowError, Task

if TYPE_CHECKING:
    from engine.api import Engine
    from pipeline.spec import JobSpec, Row
    from pipeline.tasks.prompts import PromptBuilder


class Pool(Task):
    """A pooling task: each row's prompt (a column or a template; chat messages rendered as text)."""

    def __init__(self, spec: JobSpec, engine: Engine, prompts: PromptBuilder | None, lora: bool = False):
        super().__init__(engine, lora)
        self.prompts = prompts

    def prepare(self, index: int, row: Row) -> Request:
        prompt, error = self.prompts.build(row.values)
        if isinstance(prompt, list):  # chat messages (no chat turn to answer): this row's error alone
            prompt, error = chat_or_error(self.engine, prompt)
        if prompt is None:
            raise RowError(error)
        return Request(index, prompt)

    def collect(self, row: Row, request: Request, out) -> RowResult:
        if out.error is not None:
            return RowResult(num_prompt_tokens=out.num_prompt_tokens, error=out.error, ran=True)
        result = RowResult("", out.num_prompt_tokens, 0, "stop", None, ran=True)
        self.fill(result, out)
        return result

    @abstractmethod
    def fill(self, result: RowResult, out) -> None:
        """The task's own fields of a row the engine pooled."""


class Embed(Pool):
    """task embed: the embedding column (embed.dimensions cuts a Matryoshka model's; embed.normalize)."""

    def __init__(self, spec: JobSpec, engine: Engine, prompts: PromptBuilder, lora: bool = False):
        super().__init__(spec, engine, prompts, lora)
        self.params = PoolingParams(dimensions=spec.embed.dimensions, normalize=spec.embed.normalize)

    def call(self, requests: list[Request]) -> list:
        return self.engine.embed([r.prompt for r in requests], self.params, **self.loras(requests))

    def fill(self, result: RowResult, out) -> None:
        result.embedding = out.embedding


class Classify(Pool):
    """task classify: class_label (the id2label name of the most probable class) and class_probs."""

    def call(self, requests: list[Request]) -> list:
        return self.engine.classify([r.prompt for r in requests], **self.loras(requests))

    def fill(self, result: RowResult, out) -> None:
        result.class_label = result.label = out.label
        result.class_probs = out.probs


class Score(Pool):
    """task score: the pair in score.text_1_column and score.text_2_column -> a cross-encoder's score,
    or the cosine of their embeddings."""

    def __init__(self, spec: JobSpec, engine: Engine, prompts: PromptBuilder | None = None, lora: bool = False):
        super().__init__(spec, engine, None, lora)
        self.columns = (spec.score.text_1_column, spec.score.text_2_column)

    def prepare(self, index: int, row: Row) -> Request:
        pair = [row.get(n) for n in self.columns]
        if not all(isinstance(t, str) for t in pair):
            raise RowError(f"score: columns {self.columns[0]!r} and {self.columns[1]!r} must hold text, "
                           f"got {pair!r}"[:300])
        return Request(index, pair)

    def call(self, requests: list[Request]) -> list:
        return self.engine.score([r.prompt[0] for r in requests], [r.prompt[1] for r in requests],
                                 **self.loras(requests))

    def fill(self, result: RowResult, out) -> None:
        result.score = out.score
