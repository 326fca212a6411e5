"""The job spec's pooling tasks (embed, classify, score): their sections and cross-field rules."""
from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from pipeline.spec.schema import JobSpec

POOLING_TASKS = ("embed", "classify", "score")


class EmbedSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dimensions: int | None = Field(
        None, ge=1, description="task embed: keep the first N dimensions (Matryoshka models only, as their config "
        "names them); None = the model's width.")
    normalize: bool | None = Field(
        None, description="task embed: L2-normalise each embedding; None = as the model says (a sentence-"
        "transformers Normalize module; decoder LMs without one: yes).")


class ScoreSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text_1_column: str = Field("text_1", description="task score: column of each pair's first text (the query).")
    text_2_column: str = Field("text_2", description="task score: column of each pair's second text (the document).")


def check_pooling(spec: JobSpec) -> None:
    """Rules of the pooling tasks (one message naming the keys involved)."""
    pooling = spec.task in POOLING_TASKS
    if not pooling:
        if spec.embed != EmbedSpec() or spec.score != ScoreSpec():
            raise ValueError(f"embed and score sections apply to tasks embed and score, not task {spec.task}")
        return
    if spec.task != "embed" and spec.embed != EmbedSpec():
        raise ValueError(f"embed.*: task {spec.task} makes no embeddings; drop the embed section")
    if spec.task != "score" and spec.score != ScoreSpec():
        raise ValueError(f"score.*: task {spec.task} scores no pairs; drop the score section")
    if spec.sampling.n > 1:
        raise ValueError(f"sampling.n: task {spec.task} draws no samples; drop it")
    label = spec.label
    if label.choices or label.choices_column or label.label_regex or label.json_schema is not None:
        raise ValueError(f"label.*: task {spec.task} does not generate labels; drop the label section")
    if spec.task == "score" and spec.score.text_1_column == spec.score.text_2_column:
        raise ValueError("score.text_1_column and score.text_2_column must name two columns")
    ev = spec.eval
    if ev.reference_column and spec.task != "classify":
        raise ValueError(f"eval.reference_column: task {spec.task} has no label to compare; only classify reports "
                         "accuracy")
    if spec.task == "classify" and ev.reference_column and "metrics" not in ev.model_fields_set:
        ev.metrics = ["accuracy"]
    if spec.task == "classify" and ev.reference_column and ev.metrics != ["accuracy"]:
        raise ValueError("eval.metrics: task classify reports accuracy (its label against eval.reference_column)")


def reports_metrics(spec: JobSpec) -> bool:
    """Whether the job writes metrics.json: task eval, or classify against eval.reference_column."""
    return spec.task == "eval" or (spec.task == "classify" and bool(spec.eval.reference_column))
