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

    def decode(self, token_ids: list[int]) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=True)


def find_stop(text: str, stops: list[str], start: int = 0) -> tuple[int, str] | None:
    """Earliest (index, stop string) in text[start:], or None. Indexes are character offsets,
    so a cut there never splits a multi-byte character."""
    best: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop, start)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, stop)
    return best
