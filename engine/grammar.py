"""Constrained decoding through xgrammar: one compiled grammar per constraint (cached by its
text), one matcher per constrained row, a token bitmask filled for constrained rows only and
applied to the logits on the device before sampling.

JSON is generated compact (no free whitespace), so a weak model cannot pad an object forever.
"""
from __future__ import annotations

import logging

import torch

from engine.sequence import Sequence
from engine.structured_outputs import StructuredOutputsParams

log = logging.getLogger(__name__)


UNESCAPED_CHAR = '[^\\"\\\\\\r\\n]'
"""xgrammar's character class for the characters of length-bounded strings, as it prints it:
it lets control characters through, which strict JSON parsers reject (unbounded strings
exclude them)."""
STRICT_CHAR = '[^\\0-\\x1f\\"\\\\\\r\\n]'


def json_schema_ebnf(xgr, schema) -> str:
    """The EBNF of a JSON Schema, compact (no free whitespace), with no raw control character
    allowed inside any string, so every output parses as strict JSON."""
    import json

    text = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
    return text.replace(UNESCAPED_CHAR, STRICT_CHAR)


class GrammarBackend:
    """Compiles constraints for one engine's tokenizer and vocabulary, and steps their matchers."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: set[int]):
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler = None
        self._compiled: dict[str, object] = {}
        self._bitmask: torch.Tensor | None = None

    def _xgr(self):
        import xgrammar

        if self._compiler is None:
            info = xgrammar.TokenizerInfo.from_huggingface(self.hf_tokenizer, vocab_size=self.vocab_size,
                                                           stop_token_ids=self.stop_token_ids or None)
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=2)
        return xgrammar

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of `params` (cached); ValueError naming the cause if it is invalid."""
        key = params.key()
        if key in self._compiled:
            return self._compiled[key]
        xgr = self._xgr()
        c = self._compiler
        try:
            if params.json is not None:
                grammar = c.compile_grammar(json_schema_ebnf(xgr, params.json))
            elif params.regex is not None:
                grammar = c.compile_regex(params.regex)
            elif params.choice is not None:
                alternatives = " | ".join('"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"' for s in params.choice)
                grammar = c.compile_grammar(f"root ::= {alternatives}")
            elif params.grammar is not None:
                grammar = c.compile_grammar(params.grammar)
            else:  # json_object: any object, compact like the schema outputs
                grammar = c.compile_grammar(json_schema_ebnf(xgr, {"type": "object"}))
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses with the parser's message
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"structured_outputs.{params.kind}: {first}") from None
        del xgr
        self._compiled[key] = grammar
        return grammar

    def start(self, seq: Sequence) -> None:
        """Gives a constrained row its matcher (advanced over any output it already has)."""
        import xgrammar

        matcher = xgrammar.GrammarMatcher(self.compile(seq.params.structured_outputs))
        for token in seq.output_token_ids:
            matcher.accept_token(token)
        seq.matcher = matcher

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Masks, in place, the tokens each constrained row's grammar forbids now. logits (B, V)."""
        local = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if not local:
            return
        xgr = self._xgr()
        rows = len(seqs)
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            self._bitmask = xgr.allocate_token_bitmask(max(rows, 8), self.vocab_size)
        mask = self._bitmask[:rows]
        for i in local:
            seqs[i].matcher.fill_next_token_bitmask(mask, i)
        xgr.apply_token_bitmask_inplace(logits, mask.to(logits.device, non_blocking=True), indices=local)

    @staticmethod
    def accept(seqs: list[Sequence]) -> list[Sequence]:
        """Feeds each constrained row its new token; returns the rows whose grammar is complete
        (their output is whole: they stop)."""
        done = []
        for seq in seqs:
            m = seq.matcher
            if m is None or seq.finish_reason is not None:
                continue
            token = seq.output_token_ids[-1]
            if not m.accept_token(token):
                log.warning("grammar rejected token %d of request %d", token, seq.index)
            if m.is_terminated():
                done.append(seq)
        return done
