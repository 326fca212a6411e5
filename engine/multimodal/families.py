"""The vision-language families the engine runs, by the model's config: how each is loaded, which
token marks an image's positions, how its vision tower turns pixels into the embeddings that go
in at those positions, and (Qwen2.5-VL) the M-RoPE positions of a prompt with images. Any other
family with a vision tower is refused in one line naming the ones run."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Family:
    """A family whose processor puts one run of placeholder tokens per image (LLaVA-1.5)."""

    name: str
    """What users call it (in refusals and docs)."""
    model_types: tuple[str, ...]
    """config.json's model_type values it covers."""
    special_tokens: tuple[str, ...] = ()
    """Marker tokens the family's layout is read from."""
    processor_class: str | None = None
    """transformers' processor class of a family whose processor also holds a video processor
    (read without it: engine.multimodal.families.images_only); None: AutoProcessor's."""

    def processor(self, model_dir, trust_remote_code: bool = False):
        """The model's transformers processor (image processor, tokenizer, chat template)."""
        from transformers import AutoProcessor

        if self.processor_class is not None:
            return images_only(self.processor_class, model_dir, trust_remote_code)
        return AutoProcessor.from_pretrained(model_dir, trust_remote_code=trust_remote_code)

    def image_token_id(self, hf_config) -> int:
        value = getattr(hf_config, "image_token_id", None)
        return int(value if value is not None else hf_config.image_token_index)

    def image_runs(self, ids: list[int], runs: list[tuple[int, int]], special: dict) -> list[list[tuple[int, int]]]:
        """The placeholder runs of each image, in order."""
        return [[run] for run in runs]

    def image_pixels(self, batch, counts: list[int]) -> list[dict]:
        """The processor's output for one prompt -> each image's own vision-tower inputs."""
        pixels = batch.get("pixel_values")
        return [{"pixel_values": pixels[i]} for i in range(len(counts))]

    any_size = False
    """Whether images of any size go through the vision tower in one call (Qwen2.5-VL: their
    patches one after another); else one call per pixel shape."""

    def collate(self, pixels: list[dict]) -> dict:
        """Images' own vision-tower inputs (image_pixels) -> one call's: stacked."""
        return {k: torch.stack([p[k] for p in pixels]) for k in pixels[0]}

    def features(self, model, pixels: dict) -> list[torch.Tensor]:
        """n images' inputs stacked ({"pixel_values": (n, 3, H, W)}) -> n (tokens, hidden)
        embeddings in the language model's input space, one vision-tower call for all n."""
        cfg = model.config
        out = model.model.get_image_features(pixel_values=pixels["pixel_values"],
                                             vision_feature_layer=cfg.vision_feature_layer,
                                             vision_feature_select_strategy=cfg.vision_feature_select_strategy)
        return list(out.pooler_output)

    def rope_index(self, model):
        """What rope_positions needs of the loaded model (None: positions are token indices)."""
        return None

    def rope_positions(self, batch, rope_index):
        """A processed prompt's (3, tokens) M-RoPE positions, or None where they are its indices."""
        return None


@dataclass(frozen=True)
class Tiled(Family):
    """Idefics3's layout: an image is cut into tiles, each a run of placeholders after its
    <row_r_col_c> marker, then the whole image downscaled, a run after <global-img>; the
    processor's pixel_values hold every tile of every image, in order, beside a pixel mask."""

    special_tokens: tuple[str, ...] = ("<global-img>",)

    def image_runs(self, ids, runs, special):
        marker, groups, current = special["<global-img>"], [], []
        for start, n in runs:
            current.append((start, n))
            if start and ids[start - 1] == marker:  # the whole image's run ends the image
                groups.append(current)
                current = []
        return groups + ([current] if current else [])

    def image_pixels(self, batch, counts):
        pixels, mask, out, at = batch["pixel_values"][0], batch.get("pixel_attention_mask"), [], 0
        for n in counts:
            one = {"pixel_values": pixels[at:at + n]}
            if mask is not None:
                one["pixel_attention_mask"] = mask[0, at:at + n]
            out.append(one)
            at += n
        return out

    def features(self, model, pixels):
        """Each image on its own (tile counts differ); its tiles' embeddings in token order."""
        masks = pixels.get("pixel_attention_mask")
        out = []
        for i, tiles in enumerate(pixels["pixel_values"]):
            kwargs = {"pixel_attention_mask": masks[i][None]} if masks is not None else {}
            feats = model.model.get_image_features(pixel_values=tiles[None], **kwargs).pooler_output
            out.append(torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats.reshape(-1, feats.shape[-1]))
        return out


@dataclass(frozen=True)
class MRope(Family):
    """Qwen2.5-VL's layout: one run of placeholders per image, as many as its patch grid over
    the merge size squared; every image's patches in one flat pixel_values beside their grids.
    Dynamic resolution: an image becomes a grid of 14-pixel patches at about its own size, each
    2x2 merged into one placeholder. M-RoPE: a token's rotary position has a time, a height and
    a width part; an image's placeholders take their grid coordinates after the text before it,
    and the text after it goes on from one past the largest."""

    any_size = True

    def image_pixels(self, batch, counts):
        grids = batch["image_grid_thw"]
        sizes = grids.prod(-1).tolist()
        return [{"pixel_values": patches, "image_grid_thw": grid}
                for patches, grid in zip(torch.split(batch["pixel_values"], sizes), grids)]

    def collate(self, pixels):
        """Images of any grid: their patches one after another, their grids stacked (as the
        processor gives a batch)."""
        return {"pixel_values": torch.cat([p["pixel_values"] for p in pixels]),
                "image_grid_thw": torch.stack([p["image_grid_thw"] for p in pixels])}

    def features(self, model, pixels):
        """n images (all their patches, and (n, 3) grids) through the vision tower at once."""
        out = model.model.get_image_features(pixel_values=pixels["pixel_values"],
                                             image_grid_thw=pixels["image_grid_thw"])
        return list(out.pooler_output)

    def rope_index(self, model):
        return model.model.get_rope_index

    def rope_positions(self, batch, rope_index) -> np.ndarray | None:
        """(3, prompt tokens) M-RoPE positions of a processed prompt with images, by transformers'
        own get_rope_index (None without images: every part is the token's index)."""
        if batch.get("image_grid_thw") is None:
            return None
        positions, _ = rope_index(batch["input_ids"], mm_token_type_ids=batch["mm_token_type_ids"],
                                  image_grid_thw=batch["image_grid_thw"])
        return positions[:, 0].numpy().astype(np.int64)


def images_only(name: str, model_dir, trust_remote_code: bool = False):
    """transformers' processor class `name` for images alone, built through public APIs: its image
    processor (AutoImageProcessor) and tokenizer (AutoTokenizer) handed to its constructor with the
    settings its processor_config.json holds (get_processor_dict), the video processor left out.
    Its images are processed and their placeholders expanded by transformers' own code, but a video
    processor needs torchvision, whose wheels do not load beside the CPU build of torch (and
    AutoProcessor then hands back the bare tokenizer). ValueError in one line, naming the
    transformers release, where that release cannot build it."""
    import inspect

    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    try:
        base = getattr(transformers, name)
        settings, _ = base.get_processor_dict(str(model_dir))
        parts = ("image_processor", "tokenizer", "video_processor")
        accepted = inspect.signature(base.__init__).parameters
        kwargs = {key: value for key, value in settings.items() if key in accepted and key not in parts}
        image_processor = AutoImageProcessor.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        return images_processor_class(base)(image_processor, tokenizer, **kwargs)
    except (AttributeError, ImportError, OSError, TypeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{name} cannot be built for images with transformers {transformers.__version__} "
                         f"({first}); setup.cfg names the tested releases") from None


def images_processor_class(base: type) -> type:
    """A subclass of transformers' processor class `base` whose constructor takes the image
    processor and the tokenizer alone: the processor's sub-processors are the ones its constructor
    names (ProcessorMixin.get_attributes reads the signature), and the base's own constructor gets
    None for its video processor."""

    def __init__(self, image_processor, tokenizer, **kwargs):
        base.__init__(self, image_processor, tokenizer, None, **kwargs)

    return type(f"{base.__name__}ForImages", (base,), {"__init__": __init__, "__module__": __name__})


FAMILIES = (Family("LLaVA-1.5", ("llava",)),
            MRope("Qwen2.5-VL", ("qwen2_5_vl",), processor_class="Qwen2_5_VLProcessor"),
            Tiled("Idefics3", ("idefics3",)), Tiled("SmolVLM", ("smolvlm",), processor_class="SmolVLMProcessor"))
"""The families run."""
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
