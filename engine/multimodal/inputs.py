"""A prompt with images, as users already write it, turned into what the engine runs: token ids
whose image positions hold the model's placeholder token (its processor expands each image to
as many as its vision tower gives embeddings), and one ImageSpan per image.

Accepted: vLLM's {"prompt": text, "multi_modal_data": {"image": one or a list}} (the text carries
the model's image token where each image goes), and chat messages whose content parts are
{"type": "image_url", "image_url": {"url": ...}} or {"type": "image_pil", "image_pil": PIL image}
(OpenAI's and vLLM's shapes), rendered by the processor's chat template. Images load through
engine.multimodal.media's policy; more than `limit_mm_per_prompt["image"]` fail the row.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from engine.multimodal.families import Family
from engine.multimodal.media import MediaPolicy, load_image

DEFAULT_LIMIT = {"image": 4}
"""Images a prompt may carry (vLLM's limit_mm_per_prompt)."""


@dataclass
class ImageSpan:
    """One image of a row: which prompt positions hold its placeholder tokens, what it is."""

    runs: tuple[tuple[int, int], ...]
    """(start, length) of each run of its placeholder tokens, in order: one for LLaVA; one per tile
    and one for the whole image where the family splits images (Idefics3). Its embeddings fill
    them in this order."""
    digest: str
    """sha256 of its pixel values as the processor made them: names its positions in the prefix
    cache (the same image under the same prefix shares blocks; two images never do)."""
    pixels: dict | None
    """The vision tower's inputs for this image alone ({"pixel_values": ..., ...}), held until the
    row finishes (a preempted row recomputes from them)."""
    rope: np.ndarray | None = None
    """(3, length) M-RoPE positions (time, height, width) of its placeholder tokens where the
    family has them (Qwen2.5-VL), else None: a token's position is its index."""
    rope_shift: int = 0
    """With rope: position minus index of the text tokens after it (up to the next image)."""

    @property
    def length(self) -> int:
        """Placeholder tokens (= embeddings its vision tower gives)."""
        return sum(n for _, n in self.runs)

    @property
    def start(self) -> int:
        return self.runs[0][0]

    @property
    def end(self) -> int:
        return self.runs[-1][0] + self.runs[-1][1]

    def pieces(self, lo: int, hi: int):
        """(position, count, offset in its embeddings) of its placeholder positions in [lo, hi)."""
        offset = 0
        for start, n in self.runs:
            a, b = max(lo, start), min(hi, start + n)
            if a < b:
                yield a, b - a, offset + a - start
            offset += n


def image_parts(messages: list[dict]) -> tuple[list[dict], list]:
    """Chat messages -> (the messages a processor's chat template takes, every image source in
    order). image_url and image_pil parts become {"type": "image"}; a text-only conversation is
    returned as it is."""
    images, out = [], []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                url = part.get("image_url")
                images.append(url.get("url") if isinstance(url, dict) else url)
                parts.append({"type": "image"})
            elif kind == "image_pil":
                images.append(part.get("image_pil"))
                parts.append({"type": "image"})
            elif kind == "image":
                images.append(part.get("image"))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, images


class ImageInputs:
    """One vision-language engine's image prompts: its processor, family and limits."""

    def __init__(self, model_dir, family: Family, hf_config, policy: MediaPolicy, limit: dict | None,
                 trust_remote_code: bool = False, rope_index=None):
        self.processor = family.processor(model_dir, trust_remote_code)
        self.family = family
        self.rope_index = rope_index
        """The model's M-RoPE position function (Family.rope_index; None where positions are indices)."""
        self.image_token_id = family.image_token_id(hf_config)
        tokenizer = getattr(self.processor, "tokenizer", self.processor)
        self.special = {name: tokenizer.convert_tokens_to_ids(name) for name in family.special_tokens}
        """The family's marker tokens (Idefics3's <global-img>) -> their ids."""
        self.policy = policy
        self.limit = int((limit or DEFAULT_LIMIT).get("image", DEFAULT_LIMIT["image"]))

    def chat_text(self, messages: list[dict], **template_kwargs) -> str:
        """A conversation (its image parts already {"type": "image"}: image_parts) rendered by the
        processor's chat template."""
        return self.processor.apply_chat_template(messages, tokenize=False, **template_kwargs)

    def prepare(self, text: str, sources: list, add_special_tokens: bool = True) -> tuple[list[int], list[ImageSpan]]:
        """Token ids and image spans of `text` with `sources` (its images, in order): ValueError in
        one line for a row that cannot run (an image that does not load, too many, placeholders
        that do not match). `add_special_tokens=False` for a text a chat template rendered."""
        if len(sources) > self.limit:
            raise ValueError(f"{len(sources)} images in one prompt, over engine.limit_mm_per_prompt's "
                             f"{self.limit}")
        images = [load_image(s, self.policy) for s in sources]
        try:
            batch = self.processor(text=text, images=images or None, return_tensors="pt",
                                   add_special_tokens=add_special_tokens)
        except MemoryError:  # this row's images, not the KV pool: the row fails, the engine goes on
            raise ValueError(f"the processor ran out of memory on this prompt's {len(images)} image(s) "
                             f"({', '.join(f'{i.width}x{i.height}' for i in images)})") from None
        except Exception as exc:  # noqa: BLE001  whatever the processor raises on one row's inputs fails that row
            text = str(exc).strip()
            raise ValueError(f"the processor refused the prompt: {type(exc).__name__}: "
                             f"{text.splitlines()[0] if text else ''}") from None
        ids = batch["input_ids"][0].tolist()
        groups = self.family.image_runs(ids, placeholder_runs(ids, self.image_token_id), self.special)
        if len(groups) != len(images):
            raise ValueError(f"the prompt has {len(groups)} image placeholders for {len(images)} images")
        spans = []
        for runs, pixels in zip(groups, self.family.image_pixels(batch, [len(g) for g in groups])):
            digest = hashlib.sha256(b"".join(t.contiguous().numpy().tobytes() for t in pixels.values())).hexdigest()
            spans.append(ImageSpan(tuple(runs), digest, pixels))
        if self.rope_index is not None and spans:
            positions = self.family.rope_positions(batch, self.rope_index)
            for span in spans:
                span.rope = positions[:, [p for start, n in span.runs for p in range(start, start + n)]]
                after = span.end  # the first token past the image: its position minus its index
                span.rope_shift = (int(positions[0, after]) if after < len(ids) else int(span.rope.max()) + 1) - after
        return ids, spans


def placeholder_runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each run of `token` in ids."""
    runs, start = [], None
    for i, t in enumerate(ids + [None]):
        if t == token and start is None:
            start = i
        elif t != token and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


def media_policy(config) -> MediaPolicy:
    """Where an engine's images may come from and how large they may be (EngineConfig's fields)."""
    return MediaPolicy(config.allowed_local_media_path, tuple(config.allowed_media_domains or ()),
                       config.max_image_pixels, allowed_media_buckets=tuple(config.allowed_media_buckets or ()),
                       max_image_aspect_ratio=config.max_image_aspect_ratio)
