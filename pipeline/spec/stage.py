"""A stage as the tasks run it: what a row goes through (its StageSpec), how a row becomes a prompt,
and the formats rows come in and go out in. A job's stage comes from its spec (JobSpec.stage());
a processor's from its config, with the Dataset's rows as they are."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.spec.schema import InputSpec, StageSpec


@dataclass(frozen=True)
class Stage:
    """One stage of rows -> results."""

    spec: StageSpec
    """Model, task, engine, sampling, label, eval, embed, score, lora, seed."""
    prompts: InputSpec | None = None
    """How a row becomes a prompt (a job's input section: prompt_column, template, messages_column,
    image_column, system_prompt, few_shot); None: the caller builds prompts (a processor's rows)."""
    sampling_column: str | None = None
    """The column of each row's own sampling fields, over the spec's."""
    requests: bool = False
    """The rows are OpenAI Batch request lines (input.format openai_batch)."""
    lines: bool = False
    """The results are written as OpenAI Batch lines (output.format openai_batch): one line per request,
    with its n choices."""
    columns: list[str] | None = None
    """Input columns passed to the output (None: all of them)."""

    @property
    def image_column(self) -> str | None:
        """A column of images, left out of the output unless `columns` names it."""
        return self.prompts.image_column if self.prompts is not None else None

    @staticmethod
    def of(spec) -> Stage:
        """`spec` as a stage: a Stage as it is, a JobSpec's stage."""
        return spec if isinstance(spec, Stage) else spec.stage()
