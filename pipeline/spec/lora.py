"""The job spec's LoRA section: which adapters a job serves and which rows run under which.

`lora.adapters` names adapters (name -> path or Hub id) and `lora.path` is a folder whose
subfolders are adapters (named by their folder, listed once by the driver). Rows pick their adapter
by `lora.column` (null or empty = the base model), or with `lora.each` every row runs under every
adapter (and the base model with `include_base`): the eval-many-fine-tunes workload. Output rows
then carry an `adapter` column, and exactly-once holds per (id, adapter)."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

ADAPTER = "adapter"
"""The output column naming each row's adapter (null: the base model)."""


class LoRASpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    adapters: dict[str, str] = Field(
        default_factory=dict, description="LoRA adapters by name: a PEFT directory (local, s3://, gs://) or a Hugging "
        "Face Hub id each.")
    path: str | None = Field(
        None, description="A folder (local, s3://, gs://) whose subfolders are PEFT adapters, each named by its folder "
        "(Ray Data LLM's dynamic_lora_loading_path); listed once when the job starts.")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec options for lora.path and adapters on object storage.")
    column: str | None = Field(
        None, description="Input column naming each row's adapter (null or empty = the base model); an unknown name "
        "is that row's error.")
    each: bool = Field(
        False, description="Run every input row under every adapter: one output row per (id, adapter).")
    include_base: bool = Field(
        False, description="With each: the base model's rows too (adapter null).")

    @property
    def active(self) -> bool:
        return bool(self.adapters or self.path)

    @property
    def each_adapters(self) -> list[str]:
        """lora.each: the adapters every row runs under, in order ("" = the base model, first)."""
        return ([""] if self.include_base else []) + sorted(self.adapters)


def check_lora(spec, requests: bool = False) -> None:
    """The section's rules (one message naming the keys); `requests`: the rows are OpenAI Batch request
    lines, which name their adapter by body.model."""
    lora = spec.lora
    if not lora.active:
        if lora.column or lora.each or lora.include_base:
            raise ValueError("lora.column / lora.each need adapters: set lora.adapters or lora.path")
        return
    if requests:
        if lora.each or lora.column:
            raise ValueError("lora.each / lora.column: OpenAI Batch lines name their adapter by body.model; drop them")
        return
    if bool(lora.column) == lora.each:
        raise ValueError("lora: set lora.column (each row names its adapter) or lora.each: true (every row under "
                         "every adapter), one of them")
    if lora.include_base and not lora.each:
        raise ValueError("lora.include_base applies to lora.each (with lora.column a row names no adapter for the "
                         "base model)")
    bad = [name for name in lora.adapters if not name or name != name.strip() or "/" in name]
    if bad:
        raise ValueError(f"lora.adapters: {bad[0]!r} is not an adapter name (non-empty, no '/', no surrounding "
                         "spaces)")
