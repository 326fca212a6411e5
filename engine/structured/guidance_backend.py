"""llguidance (vLLM's `guidance` backend): constraints become llguidance grammars, parsed once
into a matcher that each constrained row copies; it fills the same bitmask as xgrammar.

It enforces JSON Schema keywords xgrammar approximates (a `pattern` with `minLength` /
`maxLength`, `oneOf`, `allOf`) and names the keywords it cannot enforce; those schemas are
compiled leniently (the keywords dropped) and their outputs are checked after generation
(engine.structured.check). Its parser runs under llguidance's resource limits, so an untrusted
schema cannot take unbounded time or memory per step.
"""
from __future__ import annotations

import json
import os

from engine.api.errors import ConstraintError
from engine.api.structured_outputs import StructuredOutputsParams

JSON_OPTIONS = {"whitespace_flexible": False, "lenient": True}
"""Compact JSON, as xgrammar's; unimplemented keywords dropped (and named) instead of refused."""
FILL_THREADS = max(1, min(4, os.cpu_count() or 1))
"""Threads of the executor that fills the masks. The fill runs between forward passes, while
torch's threads wait: on 2 cores, 64 rows at 32k take 1.8 ms a step with 2 threads against 3.1 ms
with one (llguidance's mask is ~50 us a row; xgrammar's batched fill is faster alone, see
xgrammar_backend.FILL_THREADS)."""


class GuidanceGrammar:
    """A parsed constraint: the matcher every row starts from, and what llguidance dropped."""

    def __init__(self, matcher, text: str, dropped: list[str]):
        self.matcher = matcher
        self.text = text
        self.dropped = dropped
        """llguidance's warnings, e.g. 'Unimplemented keys: ["not"]'."""


class Guidance:
    """One engine's llguidance tokenizer (built on first use, ~0.2 s at 32k) and matcher calls."""

    name = "guidance"

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self._tokenizer = None
        self._executor = None

    @staticmethod
    def unavailable(hf_tokenizer) -> str | None:
        """Why llguidance cannot run for this tokenizer (None: it can)."""
        try:
            import llguidance.hf  # noqa: F401
        except ImportError:
            return "the llguidance package is not installed"
        from transformers import PreTrainedTokenizerFast

        if not isinstance(hf_tokenizer, PreTrainedTokenizerFast):
            return f"llguidance needs a fast (tokenizers) tokenizer, not {type(hf_tokenizer).__name__}"
        return None

    def _llg(self):
        import llguidance
        import llguidance.hf

        if self._tokenizer is None:
            why = self.unavailable(self.hf_tokenizer)
            if why:
                raise ConstraintError(f"structured_outputs_backend guidance: {why}")
            self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                           eos_token=self.stop_token_ids or None)
        return llguidance

    @staticmethod
    def grammar_text(params: StructuredOutputsParams) -> str:
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import gbnf_to_lark

        if params.json is not None or params.json_object:
            schema = params.json if params.json is not None else {"type": "object"}
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if params.regex is not None:
            return LLMatcher.grammar_from_regex(params.regex)
        if params.choice is not None:  # JSON string literals are Lark's
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
        return LLMatcher.grammar_from_lark(gbnf_to_lark(params.grammar))

    def compile(self, params: StructuredOutputsParams) -> GuidanceGrammar:
        """The parsed constraint; raises ValueError with llguidance's reason when it is invalid."""
        llg = self._llg()
        text = self.grammar_text(params)
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(text, self._tokenizer, limits=self.limits())
        if failed:
            raise ValueError(messages[0] if messages else "llguidance refused the grammar")
        matcher = llg.LLMatcher(self._tokenizer, text, log_level=0, limits=self.limits())
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return GuidanceGrammar(matcher, text, messages)

    @staticmethod
    def limits():
        import llguidance

        return llguidance.LLParserLimits(verbose_errors=False)  # errors name the cause, not the parser's state

    @staticmethod
    def size(compiled: GuidanceGrammar) -> int:
        return len(compiled.text)

    @staticmethod
    def matcher(compiled: GuidanceGrammar):
        return compiled.matcher.deep_copy()

    def fill(self, matchers: list, mask, indices: list[int]) -> None:
        llg = self._llg()
        import llguidance.torch

        if self._executor is None:
            self._executor = llg.LLExecutor(FILL_THREADS)
        llguidance.torch.fill_next_token_bitmask_par(self._executor, list(zip(matchers, indices)), mask)

    @staticmethod
    def accept(matchers: list, tokens: list[int]) -> list[bool]:
        return [m.consume_token(t) for m, t in zip(matchers, tokens)]

    @staticmethod
    def accept_one(matcher, token: int) -> bool:
        return matcher.consume_token(token)

    @staticmethod
    def terminated(matcher) -> bool:
        """It is done: whole (only EOS could follow), or in an error state it never leaves (a
        resource limit hit mid-output), whose output the check then refuses."""
        return matcher.is_stopped() or matcher.is_error()

    @staticmethod
    def accepting(matcher) -> bool:
        return not matcher.is_error() and (matcher.is_accepting() or matcher.is_stopped())
