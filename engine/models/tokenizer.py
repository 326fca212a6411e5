"""Text <-> token ids, and stop-string matching on decoded text."""
from __future__ import annotations

import numpy as np


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
        self._pieces: list[str] | None = None
        self._enders: dict[frozenset[str], np.ndarray] = {}
        self.max_tokens: int | None = None
        """The most tokens a text may become (the engine's max_model_len): a text that cannot fit is
        refused before it is tokenized (a 10 MB prompt would take the tokenizer 20 s)."""
        self._longest_piece: int | None = None

    def _check_length(self, text: str) -> None:
        """ValueError when `text` has more characters than max_tokens tokens can spell, with no
        token longer than the vocabulary's longest piece (twice that, for normalizers)."""
        if self.max_tokens is None or len(text) <= 64 * self.max_tokens:
            return
        if self._longest_piece is None:
            self._longest_piece = max((len(piece) for piece in self.hf.get_vocab()), default=1)
        if len(text) > 2 * self._longest_piece * self.max_tokens:
            raise ValueError(f"prompt is {len(text)} characters, more than max_model_len ({self.max_tokens} tokens) "
                             f"can hold: refused before tokenizing")

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with the special tokens the model expects (e.g. BOS)."""
        self._check_length(text)
        return self.hf(text, add_special_tokens=True, verbose=False)["input_ids"]

    def encode_prompt(self, prompt, vocab_size: int) -> list[int]:
        """A request's prompt (text, or token ids each inside [0, vocab_size)) -> its token ids;
        ValueError or TypeError in one line for one that cannot run."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("empty prompt: a request needs at least one prompt token")
            return self.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
            return list(prompt)
        raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def encode_continuation(self, text: str) -> list[int]:
        """Token ids of `text` as it continues a prompt: no special tokens."""
        if not isinstance(text, str) or not text:
            raise ValueError(f"a choice must be non-empty text, got {text!r}")
        return self.hf(text, add_special_tokens=False, verbose=False)["input_ids"]

    def continuation(self, prompt: str | list[int], prompt_ids: list[int], choice: str | list[int]) -> list[int]:
        """A choice's token ids as they follow the prompt: for text, the tokens that prompt + choice
        has beyond the prompt's own (tokenizers that merge across the boundary or add a prefix
        space agree with how the text would be read); else the choice tokenized on its own."""
        if not isinstance(choice, str):
            return list(choice)
        if isinstance(prompt, str) and choice:
            whole = self.encode(prompt + choice)
            if len(whole) > len(prompt_ids) and whole[: len(prompt_ids)] == prompt_ids:
                return whole[len(prompt_ids):]
        return self.encode_continuation(choice)

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
            raise ValueError(f"the chat template refused these messages: {' '.join(str(exc).split())}") from None
        self._check_length(text)
        # The template writes any BOS itself; adding special tokens again would double it.
        return self.hf(text, add_special_tokens=False, verbose=False)["input_ids"]

    def decode(self, token_ids: list[int]) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=True)

    def decode_as(self, token_ids: list[int], skip_special_tokens: bool = True,
                  spaces_between_special_tokens: bool = True) -> str:
        """The text of `token_ids` under vLLM's two detokenizing options: with special tokens kept,
        each stands as its own text, joined to the text around it by a space (or not)."""
        if skip_special_tokens:
            return self.decode(token_ids)
        special = set(self.hf.all_special_ids)
        parts, run = [], []
        for token in token_ids:
            if token in special:
                if run:
                    parts.append(self.hf.decode(run))
                    run = []
                parts.append(self.hf.convert_ids_to_tokens(token))
            else:
                run.append(token)
        if run:
            parts.append(self.hf.decode(run))
        return (" " if spaces_between_special_tokens else "").join(parts)

    def decode_batch(self, token_ids: list[list[int]]) -> list[str]:
        """Several texts, each exactly as `decode` would give it."""
        return self.hf.batch_decode(token_ids, skip_special_tokens=True)

    def decode_windows(self, token_ids: list[list[int]]) -> list[str]:
        """Several short texts in one call to the Rust tokenizer where that gives the same text
        as `decode` (no clean-up of tokenization spaces configured)."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None or getattr(self.hf, "clean_up_tokenization_spaces", False):
            return self.decode_batch(token_ids)  # the same text `decode` gives, so matches agree
        return backend.decode_batch(token_ids, skip_special_tokens=True)

    def stop_enders(self, stops: list[str], vocab_size: int = 0) -> np.ndarray | None:
        """Per token id: whether the token can be the one that completes one of `stops`, i.e.
        its own text holds the last character of one of them, or is a piece of a multi-byte
        character (decoded alone it gives U+FFFD). In context a token's text holds the same
        characters, spaces aside (SentencePiece drops a leading one when a token stands alone),
        so None (every token may) when a stop string ends in whitespace. Built once per set of
        last characters, from one decode of every id alone, up to the model's `vocab_size` (ids
        the tokenizer does not know decode to nothing; where decoding them fails, they may
        always end one)."""
        last = frozenset(stop[-1] for stop in stops)
        if any(c.isspace() for c in last):
            return None
        if last not in self._enders:
            if self._pieces is None:
                self._pieces = self._decode_each(max(vocab_size, len(self.hf)))
            self._enders[last] = np.fromiter(
                (any(c in piece for c in last) or "\ufffd" in piece for piece in self._pieces),
                dtype=bool, count=len(self._pieces))
        return self._enders[last]

    def _decode_each(self, n: int) -> list[str]:
        try:
            return self.decode_windows([[i] for i in range(n)])
        except Exception:  # noqa: BLE001  a slow tokenizer that refuses ids past its vocabulary
            return self.decode_windows([[i] for i in range(len(self.hf))])


def find_stop(text: str, stops: list[str], ends_after: int = 0) -> tuple[int, str] | None:
    """Earliest (index, stop string) in text among the occurrences that end after the first
    `ends_after` characters (each stop string by its own length), or None. Indexes are character
    offsets, so a cut there never splits a multi-byte character."""
    best: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop, max(0, ends_after - len(stop) + 1))
        if at >= 0 and (best is None or at < best[0]):
            best = (at, stop)
    return best


class StopStringChecker:
    """Finds a request's stop strings as tokens arrive by decoding only a window of its last
    tokens, never the whole output: the window holds every token a stop string can span (a
    character may take up to 4 byte-level tokens), plus the token before it. Since a request
    stops at its first stop string, any stop string inside the window is a new one, except
    within a window of min_tokens, where held-back ones stay (`stop_string_hits` checks those
    rows against their whole output)."""

    def __init__(self, stops: list[str], enders: np.ndarray | None = None):
        self.stops = stops
        self.window = 4 * max(len(s) for s in stops) + 1
        """Tokens to decode each step."""
        self.enders = enders
        """Tokenizer.stop_enders for these stops: a step whose token cannot complete one skips
        the decode (None: every step decodes)."""

    def may_stop(self, token: int) -> bool:
        """Whether the row's newest token can complete a stop string (decode the window then)."""
        e = self.enders
        return e is None or token >= len(e) or bool(e[token])

    def found(self, window_text: str) -> bool:
        """Whether the decoded window holds a stop string."""
        return any(stop in window_text for stop in self.stops)
