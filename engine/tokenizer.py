"""Text <-> token ids, and stop-string matching on decoded text."""
from __future__ import annotations


class Tokenizer:
    """Wraps a Hugging Face tokenizer with what the engine needs."""

    def __init__(self, hf_tokenizer, eos_token_ids: set[int] | None = None):
        self.hf = hf_tokenizer
        ids = set(eos_token_ids or ())
        if hf_tokenizer.eos_token_id is not None:
            ids.add(hf_tokenizer.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(ids)
        pad = hf_tokenizer.pad_token_id
        self.pad_token_id: int = pad if pad is not None else (min(ids) if ids else 0)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with the special tokens the model expects (e.g. BOS)."""
        return self.hf(text, add_special_tokens=True, verbose=False)["input_ids"]

    def encode_continuation(self, text: str) -> list[int]:
        """Token ids of `text` as it continues a prompt: no special tokens."""
        if not isinstance(text, str) or not text:
            raise ValueError(f"a choice must be non-empty text, got {text!r}")
        return self.hf(text, add_special_tokens=False, verbose=False)["input_ids"]

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation rendered by the model's chat template, ending with the
        assistant's turn (add_generation_prompt)."""
        if not self.has_chat_template:
            raise ValueError("the model's tokenizer has no chat template, so chat messages cannot be rendered "
                             "(use a plain prompt column or template, or a model with a chat_template)")
        try:
            text = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # noqa: BLE001  jinja2 errors, templates that raise on a role order
            raise ValueError(f"the chat template refused these messages: {exc}") from None
        # The template writes any BOS itself; adding special tokens again would double it.
        return self.hf(text, add_special_tokens=False, verbose=False)["input_ids"]

    def decode(self, token_ids: list[int]) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=True)

    def decode_batch(self, token_ids: list[list[int]]) -> list[str]:
        """Several texts in one call (the Rust tokenizer decodes them in one go)."""
        return self.hf.batch_decode(token_ids, skip_special_tokens=True)


def find_stop(text: str, stops: list[str], start: int = 0) -> tuple[int, str] | None:
    """Earliest (index, stop string) in text[start:], or None. Indexes are character offsets,
    so a cut there never splits a multi-byte character."""
    best: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop, start)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, stop)
    return best


class StopStringChecker:
    """Finds a request's stop strings in its output as tokens arrive, decoding only the new
    tokens (plus a few before them, so multi-byte characters and merges decode correctly)
    instead of the whole output every step."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = stops
        self.longest = max(len(s) for s in stops)
        self.text = ""
        self._prefix = 0  # tokens before this decode only as context
        self._read = 0  # tokens up to here are in self.text

    def add(self, token_ids: list[int]) -> bool:
        """`token_ids`: the whole output so far. Returns whether a stop string has appeared."""
        decode = self.tokenizer.decode
        prefix_text = decode(token_ids[self._prefix:self._read])
        new_text = decode(token_ids[self._prefix:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return False  # an incomplete character: wait for the next token
        start = max(0, len(self.text) - self.longest + 1)
        self.text += new_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(token_ids)
        return find_stop(self.text, self.stops, start) is not None
