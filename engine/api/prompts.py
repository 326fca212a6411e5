"""The prompts of one call as a list, each with its own parameters (generate and the pooling calls)."""
from __future__ import annotations

Prompt = str | list[int] | dict
"""One prompt: its text, its token ids, or vLLM's {"prompt": text, "multi_modal_data": {"image": ...}}
(a vision-language model's prompt with images: engine.multimodal)."""


def per_prompt(prompts, params, cls) -> tuple[list, list]:
    """One prompt (text, token ids or an image prompt's dict) or a list of them, and one `cls` instance (None: its
    defaults) or one per prompt -> (prompts, params) of equal length; ValueError when they differ."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    prompts = list(prompts)
    if params is None or isinstance(params, cls):
        params = [params or cls()] * len(prompts)
    params = list(params)
    if len(params) != len(prompts):
        raise ValueError(f"got {len(prompts)} prompts but {len(params)} {cls.__name__}")
    return prompts, params
