"""The vision-language families the engine runs, by the model's config: how each is loaded, which
token marks an image's positions, and how its vision tower turns pixels into the embeddings that
go in at those positions. Any other family with a vision tower is refused in one line naming the
ones run."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Family:
    name: str
    """What users call it (in refusals and docs)."""
    model_types: tuple[str, ...]
    """config.json's model_type values it covers."""

    def image_token_id(self, hf_config) -> int:
        value = getattr(hf_config, "image_token_id", None)
        return int(value if value is not None else hf_config.image_token_index)

    def features(self, model, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """(n, 3, H, W) pixel values of n images -> n (tokens, hidden) embeddings in the language
        model's input space, one vision-tower call for all n."""
        cfg = model.config
        out = model.model.get_image_features(pixel_values=pixel_values,
                                             vision_feature_layer=cfg.vision_feature_layer,
                                             vision_feature_select_strategy=cfg.vision_feature_select_strategy)
        return list(out.pooler_output)


FAMILIES = (Family("LLaVA-1.5", ("llava",)),)
"""The families run (the first wave of images: LLaVA-1.5; Qwen2.5-VL's M-RoPE and SmolVLM's image
splitting are not run yet)."""
VISION_MODEL_TYPES = {"llava", "llava_next", "llava_onevision", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "idefics3",
                      "smolvlm", "idefics2", "mllama", "paligemma", "gemma3", "pixtral", "mistral3", "internvl",
                      "aya_vision", "llama4", "phi4_multimodal", "blip-2", "chameleon", "fuyu", "kosmos-2"}
"""model_type values of configs with a vision tower (those not in FAMILIES are refused)."""


def family_of(hf_config) -> Family | None:
    """The family of a vision-language config (None: a text-only model). A vision config of a
    family not run is a ValueError naming the ones that are."""
    model_type = getattr(hf_config, "model_type", "")
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    if model_type in VISION_MODEL_TYPES and getattr(hf_config, "vision_config", None) is not None:
        runs = ", ".join(f"{f.name} ({'/'.join(f.model_types)})" for f in FAMILIES)
        raise ValueError(f"{model_type} vision-language models are not run yet; the engine runs {runs}")
    return None
