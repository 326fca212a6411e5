"""A request's prompt as the model reads it: text or token ids to token ids, vLLM's image prompts
to token ids and image spans, chat messages through the chat template (or a vision model's
processor). Shared by the generation engine (generate, choice scoring) and the encoder engine."""
from __future__ import annotations

from engine.api.prompts import Prompt
from engine.models.tokenizer import Tokenizer
from engine.multimodal import ImageInputs, image_parts

IMAGE_PROMPT_KEYS = {"prompt", "multi_modal_data", "add_special_tokens"}


class PromptReader:
    """Prompts -> token ids (and images) for one model."""

    def __init__(self, model: str, tokenizer: Tokenizer, vocab_size: int, images: ImageInputs | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.images = images
        """A vision-language model's image inputs (engine.multimodal), else None."""

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Text or token ids -> token ids; ValueError or TypeError in one line for one that cannot run."""
        return self.tokenizer.encode_prompt(prompt, self.vocab_size)

    def read(self, prompt: Prompt) -> tuple[list[int], list]:
        """Any prompt (text, token ids, an image prompt) -> (token ids, the images' spans)."""
        return self.image_prompt(prompt) if isinstance(prompt, dict) else (self.tokenize(prompt), [])

    def encode_chat(self, messages: list[dict]) -> list[int] | dict:
        """A conversation as the engine takes it: the chat template's token ids, or, where its
        content parts hold images (image_url, image_pil, image), an image prompt rendered by the
        processor's template (engine.multimodal); a ValueError names what cannot be rendered."""
        converted, sources = image_parts(messages)
        if self.images is None and not sources:
            return self.tokenizer.encode_chat(messages)
        if self.images is None:
            raise ValueError(f"{self.model} is a text-only model: it takes no images")
        return self.chat_image_prompt(converted, sources, add_generation_prompt=True)

    def chat_image_prompt(self, converted: list[dict], sources: list, **template_kwargs) -> dict:
        """The image prompt of a conversation whose image parts image_parts() replaced (its images
        `sources`), rendered by the processor's chat template; on a text-only model an empty one,
        which the engine fails in one line."""
        text = "" if self.images is None else self.images.chat_text(converted, **template_kwargs)
        return {"prompt": text, "multi_modal_data": {"image": sources}, "add_special_tokens": False}

    def image_prompt(self, prompt: dict) -> tuple[list[int], list]:
        """vLLM's {"prompt": text, "multi_modal_data": {"image": one or a list}} -> (token ids, the
        images' spans); a ValueError in one line fails the row (a text-only model, a bad image)."""
        data = prompt.get("multi_modal_data") or {}
        if set(prompt) - IMAGE_PROMPT_KEYS or not isinstance(prompt.get("prompt"), str) \
                or not isinstance(data, dict) or set(data) - {"image"}:
            raise TypeError(f"an image prompt is {{'prompt': text, 'multi_modal_data': {{'image': ...}}}}, got "
                            f"keys {sorted(prompt)}")
        sources = data.get("image")
        sources = [] if sources is None else list(sources) if isinstance(sources, (list, tuple)) else [sources]
        if self.images is None:
            if sources:
                raise ValueError(f"{self.model} is a text-only model: it takes no images")
            return self.tokenize(prompt["prompt"]), []
        return self.images.prepare(prompt["prompt"], sources, prompt.get("add_special_tokens", True))
