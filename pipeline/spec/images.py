"""Images in a job's rows: which specs may carry them (input.image_column)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.spec.schema import JobSpec


def check_images(spec: JobSpec) -> None:
    """input.image_column's rules: a row's images go before its prompt text (prompt_column or
    template), in generate, label and eval jobs (pooling tasks take text)."""
    inp = spec.input
    if inp.image_column is None:
        return
    if inp.messages_column or inp.format == "openai_batch":
        raise ValueError("input.image_column puts a row's images before its prompt text: it takes prompt_column or "
                         "template, not messages_column or OpenAI Batch input")
    if spec.task not in ("generate", "label", "eval"):
        raise ValueError(f"input.image_column: images run in generate, label and eval jobs, not task {spec.task}")
