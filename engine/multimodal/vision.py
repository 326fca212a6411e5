"""The vision tower in the engine's passes: each image's embeddings computed once (every image a
pass needs and has not seen, in one batched call per pixel shape), kept in a bounded cache by
their content digest so a prefill split into chunks, a preempted row's recompute and a second
row with the same image reuse them, and put in at the image's placeholder positions."""
from __future__ import annotations

import time
from collections import OrderedDict

import torch

from engine.multimodal.families import Family, family_of

CACHE_IMAGES = 64
"""Images whose embeddings are kept (least recently used first out)..."""
CACHE_ROWS = 16384
"""... and embedding rows (image tokens) kept at most: on a 4096-wide bf16 model, 128 MiB."""


class VisionFeatures:
    """One engine's image embeddings: computed by `family`'s vision tower, cached by digest."""

    def __init__(self, family: Family, capacity: int = CACHE_IMAGES):
        self.family = family
        self.capacity = capacity
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.seconds = 0.0
        """Time spent in the vision tower (the share of prefill it takes: scripts/bench_vlm.py)."""
        self.images_encoded = 0
        self.tower_calls = 0
        """Vision-tower calls made (each for every image of one pixel shape a pass needed, or all)."""

    def features(self, model, spans) -> dict[str, torch.Tensor]:
        """digest -> (tokens, hidden) embeddings of each ImageSpan of `spans`, computing the missing
        ones (one vision-tower call per pixel shape, or one for all where the family takes
        images of any size together)."""
        wanted = {s.digest: s for s in spans}
        missing = [s for d, s in wanted.items() if d not in self.cache]
        by_shape: dict[tuple, list] = {}
        for span in missing:
            if span.pixels is None:
                raise RuntimeError(f"image {span.digest[:12]}'s pixels were dropped before its embeddings were made")
            shape = () if self.family.any_size else tuple((k, tuple(t.shape)) for k, t in span.pixels.items())
            by_shape.setdefault(shape, []).append(span)
        param = next(model.parameters())
        started = time.perf_counter()
        for group in by_shape.values():
            pixels = {k: t.to(device=param.device, dtype=param.dtype if t.is_floating_point() else t.dtype)
                      for k, t in self.family.collate([s.pixels for s in group]).items()}
            self.tower_calls += 1
            for span, feats in zip(group, self.family.features(model, pixels)):
                if feats.shape[0] != span.length:
                    raise ValueError(f"the vision tower gave {feats.shape[0]} embeddings for an image of "
                                     f"{span.length} placeholder tokens")
                self.cache[span.digest] = feats
                self.images_encoded += 1
        if missing:
            self.seconds += time.perf_counter() - started
        for digest in wanted:
            self.cache.move_to_end(digest)
        found = {d: self.cache[d] for d in wanted}
        rows = sum(f.shape[0] for f in self.cache.values())
        while len(self.cache) > len(wanted) and (len(self.cache) > self.capacity or rows > CACHE_ROWS):
            rows -= self.cache.popitem(last=False)[1].shape[0]  # the least recently used, never this pass's
        return found

    def embed(self, model, input_ids: torch.Tensor, images: list) -> torch.Tensor:
        """The pass's input embeddings (1, T, H): the tokens' own, and at each image placeholder
        the image's embedding. `images`: PassInputs.images, (pass index, count, feature offset, ImageSpan)."""
        embeds = model.get_input_embeddings()(input_ids)
        feats = self.features(model, [span for *_, span in images])
        for index, count, offset, span in images:
            embeds[0, index:index + count] = feats[span.digest][offset:offset + count].to(embeds.dtype)
        return embeds


def vision_features(hf_config, config) -> VisionFeatures | None:
    """The image embeddings of a vision-language model (None for a text-only one); a ValueError in
    one line for a family not run, or a setting images do not run with yet."""
    family = family_of(hf_config)
    if family is None:
        return None
    for setting, value in (("tensor_parallel_size", config.tensor_parallel_size > 1),
                           ("quantization", config.quantization is not None), ("enable_lora", config.enable_lora)):
        if value:
            raise ValueError(f"{family.name} models run without {setting} for now (images run in one process, "
                             "in the model's dtype, without adapters)")
    return VisionFeatures(family)
