"""Qwen2.5-VL: dynamic resolution (an image becomes a grid of patches at about its own size, each
2x2 of them merged into one placeholder token) and M-RoPE (a token's rotary position has a time, a
height and a width part: an image's placeholders take their grid coordinates after the text
before it, and the text after it goes on from one past the largest)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.multimodal.families import Family


@dataclass(frozen=True)
class MRope(Family):
    """Qwen2.5-VL's layout: one run of placeholders per image, as many as its patch grid over
    the merge size squared; every image's patches in one flat pixel_values beside their grids."""

    def image_pixels(self, batch, counts):
        grids = batch["image_grid_thw"]
        sizes = grids.prod(-1).tolist()
        return [{"pixel_values": patches, "image_grid_thw": grid}
                for patches, grid in zip(torch.split(batch["pixel_values"], sizes), grids)]

    def features(self, model, pixels):
        """n images of one grid ((n, patches, dim) and (n, 3)) through the vision tower at once."""
        n, patches, dim = pixels["pixel_values"].shape
        out = model.model.get_image_features(pixel_values=pixels["pixel_values"].reshape(n * patches, dim),
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
