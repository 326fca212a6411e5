"""xgrammar: JSON Schemas, regexes, choices and EBNF grammars compiled against the vocabulary into
grammars whose matchers fill a step's bitmask for all their rows in one call.

JSON is generated compact (no free whitespace), so a weak model cannot pad an object forever,
and no raw control character is allowed inside a string, so every output parses as strict JSON.
"""
from __future__ import annotations

import json

from engine.api.structured_outputs import StructuredOutputsParams

FILL_THREADS = 1
"""Threads xgrammar fills a step's masks with: one call for every row is ~3x faster than a call
per row (64 rows at 32k: 0.04 against 0.12 ms), and a second thread only contends with the
forward pass for the cores (10x slower on 2 shared cores)."""

UNESCAPED_CHAR = '[^\\"\\\\\\r\\n]'
"""xgrammar's character class for the characters of length-bounded strings, as it prints it:
it lets control characters through, which strict JSON parsers reject (unbounded strings
exclude them)."""
STRICT_CHAR = '[^\\0-\\x1f\\"\\\\\\r\\n]'


def json_schema_ebnf(xgr, schema) -> str:
    """The EBNF of a JSON Schema, compact (no free whitespace), with no raw control character
    allowed inside any string, so every output parses as strict JSON."""
    text = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
    return text.replace(UNESCAPED_CHAR, STRICT_CHAR)


_EBNF_ESCAPES = str.maketrans({"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t",
                               **{chr(c): f"\\x{c:02x}" for c in [*range(0x20), 0x7F] if chr(c) not in "\n\r\t"}})


def ebnf_literal(text: str) -> str:
    """`text` as an EBNF string literal: backslash, quote and control characters escaped (a raw
    newline or carriage return ends a literal in xgrammar's lexer)."""
    return '"' + text.translate(_EBNF_ESCAPES) + '"'


class XGrammar:
    """One engine's xgrammar compiler (built on first use) and the calls on its matchers."""

    name = "xgrammar"

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self._compiler = None
        self._batch = None
        """xgrammar's BatchGrammarMatcher: fills the masks of all its rows in one call."""

    def _xgr(self):
        import xgrammar

        if self._compiler is None:
            info = xgrammar.TokenizerInfo.from_huggingface(self.hf_tokenizer, vocab_size=self.vocab_size,
                                                           stop_token_ids=self.stop_token_ids or None)
            # xgrammar's own cache is unbounded: the engine's GrammarBackend keeps a bounded one
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        return xgrammar

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar; raises xgrammar's error on a constraint it cannot compile."""
        xgr = self._xgr()
        c = self._compiler
        if params.json is not None:
            return c.compile_grammar(json_schema_ebnf(xgr, params.json))
        if params.regex is not None:
            return c.compile_regex(params.regex)
        if params.choice is not None:
            return c.compile_grammar("root ::= " + " | ".join(map(ebnf_literal, params.choice)))
        if params.grammar is not None:
            return c.compile_grammar(params.grammar)
        return c.compile_grammar(json_schema_ebnf(xgr, {"type": "object"}))  # json_object: compact, like schemas

    @staticmethod
    def size(compiled) -> int:
        return compiled.memory_size_bytes

    @staticmethod
    def matcher(compiled):
        import xgrammar

        return xgrammar.GrammarMatcher(compiled)

    def fill(self, matchers: list, mask, indices: list[int]) -> None:
        """Writes the allowed tokens of each matcher into row `indices[i]` of `mask`."""
        xgr = self._xgr()
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(max_threads=FILL_THREADS)
        self._batch.batch_fill_next_token_bitmask(matchers, mask, indices=indices)

    @staticmethod
    def accept(matchers: list, tokens: list[int]) -> list[bool]:
        import xgrammar

        return xgrammar.BatchGrammarMatcher.batch_accept_token(matchers, tokens)

    @staticmethod
    def accept_one(matcher, token: int) -> bool:
        return matcher.accept_token(token)

    @staticmethod
    def terminated(matcher) -> bool:
        """It accepted a stop token: the output is whole and ends here."""
        return matcher.is_terminated()

    @staticmethod
    def accepting(matcher) -> bool:
        """What it accepted so far is a whole output of the grammar."""
        return matcher.is_terminated() or matcher.is_completed()
