"""A LoRA adapter a request runs under, with vLLM's names: `LoRARequest`, and `per_prompt_lora`,
which spreads one request (or None, the base model) over a call's prompts."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """One LoRA adapter: a PEFT directory (`adapter_config.json` + `adapter_model.safetensors`),
    local, on object storage (s3://, gs://: copied into the cache) or a Hugging Face Hub id.

    `lora_int_id` identifies the adapter inside the engine (as in vLLM): two requests with the same
    id are the same adapter, and one id must always name the same path."""

    lora_name: str
    """The adapter's name (what a job's `adapter` column and an OpenAI Batch body's `model` say)."""
    lora_int_id: int
    """A positive integer naming the adapter in the engine."""
    lora_path: str
    """Where its files are: a directory, an s3:// or gs:// URL, or a Hub id."""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id <= 0:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")


def per_prompt_lora(lora_request, n: int) -> list[LoRARequest | None]:
    """One LoRARequest (or None) per prompt: a single request (or None) for all n, or a list of
    exactly n (vLLM's rule: a list of another length is a ValueError)."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    if not isinstance(lora_request, (list, tuple)):
        raise TypeError(f"lora_request must be a LoRARequest, a list of them or None, "
                        f"got {type(lora_request).__name__}")
    if len(lora_request) != n:
        raise ValueError(f"lora_request is a list of {len(lora_request)} for {n} prompts: give one per prompt")
    for r in lora_request:
        if r is not None and not isinstance(r, LoRARequest):
            raise TypeError(f"lora_request entries must be LoRARequest or None, got {type(r).__name__}")
    return list(lora_request)
