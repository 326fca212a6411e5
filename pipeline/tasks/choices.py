"""Label by choices: each row's prompt -> one of `label.choices` (or its row's `choices_column`),
picked by the log-likelihood of each choice after the prompt. No token is sampled."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pipeline.tasks.generate import Generate
from pipeline.tasks.row_result import RowResult
from pipeline.tasks.task import Request, RowError

if TYPE_CHECKING:
    from engine.api import Engine
    from pipeline.spec import JobSpec, Row


class LabelByChoices(Generate):
    """The row's prompt is built as for generation (its sampling fields checked the same way); its
    choices are scored, not generated."""

    def __init__(self, spec: JobSpec, engine: Engine, prompts, **kwargs):
        super().__init__(spec, engine, prompts, **kwargs)
        label = spec.label
        self.choices = label.choices
        self.choices_column = label.choices_column
        self.choice_prefix = label.choice_prefix
        self.length_normalize = label.length_normalize

    def prepare(self, index: int, row: Row) -> Request:
        request = super().prepare(index, row)
        choices = self.choices if self.choices else row.get(self.choices_column)
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
            raise RowError(f"{self.choices_column!r} must hold a non-empty list of non-empty strings, got {choices!r}")
        request.choices = choices
        return request

    def call(self, requests: list[Request]) -> list:
        return self.engine.score_choices([r.prompt for r in requests],
                                         [[self.prefix(r.prompt) + c for c in r.choices] for r in requests],
                                         **self.loras(requests))

    def collect(self, row: Row, request: Request, scores) -> RowResult:
        if scores.error:
            return RowResult(error=scores.error)
        choices = request.choices
        per_token = [lp / n for lp, n in zip(scores.logprobs, scores.num_tokens)]
        ranking = per_token if self.length_normalize else scores.logprobs
        best = max(range(len(choices)), key=ranking.__getitem__)
        return RowResult(choices[best], scores.num_prompt_tokens, 0, "stop", None, label=choices[best],
                         label_probs=softmax(scores.logprobs), label_logprobs=scores.logprobs,
                         label_logprobs_per_token=per_token, num_cached_tokens=scores.num_cached_tokens)

    def prefix(self, prompt) -> str:
        """What goes before every choice: label.choice_prefix, else a space after a plain prompt that does
        not end in whitespace ("Sentiment:" + " positive"), nothing after a chat prompt (the assistant's
        answer starts there)."""
        if self.choice_prefix is not None:
            return self.choice_prefix
        return " " if isinstance(prompt, str) and not prompt[-1:].isspace() else ""


def softmax(logprobs: list[float]) -> list[float]:
    top = max(logprobs)
    exp = [math.exp(x - top) for x in logprobs]
    total = sum(exp)
    return [e / total for e in exp]
