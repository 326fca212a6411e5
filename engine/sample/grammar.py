"""Constrained decoding through xgrammar: one compiled grammar per constraint (cached by its
text), one matcher per constrained row, a token bitmask filled for constrained rows only and
applied to the logits on the device before sampling.

JSON is generated compact (no free whitespace), so a weak model cannot pad an object forever.

Constraints may come from untrusted input (OpenAI Batch bodies), so the backend bounds what one
can cost: a grammar is compiled in a thread with a deadline (xgrammar's compiler runs in C++ and
releases the GIL; a 113-byte schema with a nested repetition in a `pattern` takes 8 s at a 32k
vocabulary), compiled grammars sit in an LRU cache bounded in entries and bytes, and a constraint
that failed (invalid, or over the deadline) is remembered, so its next rows fail at once. A
compile past its deadline cannot be stopped: it finishes in its thread (the process waits for it
at exit) and its result is dropped; while MAX_OVERDUE such compiles still run, new constraints
are refused, so overdue work and its memory stay bounded.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import torch

from engine.api.errors import ConstraintError, GrammarBusy
from engine.api.structured_outputs import StructuredOutputsParams
from engine.core.sequence import Sequence

log = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 10.0
"""Longest a constraint may take to compile; past it, its requests fail with the reason."""
CACHE_ENTRIES = 256
"""Most compiled grammars kept per engine (least recently used leave first)."""
CACHE_BYTES = 512 << 20
"""Most bytes of compiled grammars kept per engine (xgrammar's own count of their token-mask caches)."""
FAILED_ENTRIES = 1024
"""Most failed constraints remembered (with their error) per engine."""
MAX_OVERDUE = 2
FILL_THREADS = 1
"""Threads xgrammar fills a step's masks with: one call for every row is ~3x faster than a call
per row (64 rows at 32k: 0.04 against 0.12 ms), and a second thread only contends with the
forward pass for the cores (10x slower on 2 shared cores)."""
"""Most compiles past their deadline that may still run; while they do, new constraints fail."""


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


_EBNF_ESCAPES = str.maketrans({"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t",
                               **{chr(c): f"\\x{c:02x}" for c in [*range(0x20), 0x7F] if chr(c) not in "\n\r\t"}})


def ebnf_literal(text: str) -> str:
    """`text` as an EBNF string literal: backslash, quote and control characters escaped (a raw
    newline or carriage return ends a literal in xgrammar's lexer)."""
    return '"' + text.translate(_EBNF_ESCAPES) + '"'


class GrammarBackend:
    """Compiles constraints for one engine's tokenizer and vocabulary, and steps their matchers."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: set[int],
                 compile_timeout_s: float = COMPILE_TIMEOUT_S):
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.compile_timeout_s = compile_timeout_s
        """Deadline of one compile, in seconds."""
        self._compiler = None
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._failed: OrderedDict[str, str] = OrderedDict()
        self._overdue: list[threading.Thread] = []
        self._bitmask: torch.Tensor | None = None
        self._batch = None
        """xgrammar's BatchGrammarMatcher: fills the masks of all constrained rows in one call."""

    def _xgr(self):
        import xgrammar

        if self._compiler is None:
            info = xgrammar.TokenizerInfo.from_huggingface(self.hf_tokenizer, vocab_size=self.vocab_size,
                                                           stop_token_ids=self.stop_token_ids or None)
            # xgrammar's own cache is unbounded: this backend keeps the bounded one
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        return xgrammar

    @property
    def cached_bytes(self) -> int:
        """Bytes of the compiled grammars in the cache."""
        return sum(g.memory_size_bytes for g in self._compiled.values())

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of `params` (cached); ConstraintError naming the cause if it is invalid
        or does not compile within `compile_timeout_s`."""
        key = params.key()
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return self._compiled[key]
        if key in self._failed:
            self._failed.move_to_end(key)
            raise ConstraintError(self._failed[key])
        try:
            grammar = self._compile_within_deadline(params)
        except GrammarBusy:
            raise  # not the constraint's fault: a later row may compile it
        except ConstraintError as exc:
            self._remember(self._failed, key, str(exc), FAILED_ENTRIES)
            raise
        self._remember(self._compiled, key, grammar, CACHE_ENTRIES)
        while len(self._compiled) > 1 and self.cached_bytes > CACHE_BYTES:
            self._compiled.popitem(last=False)
        return grammar

    @staticmethod
    def _remember(cache: OrderedDict, key: str, value, limit: int) -> None:
        cache[key] = value
        while len(cache) > limit:
            cache.popitem(last=False)

    def _compile_within_deadline(self, params: StructuredOutputsParams):
        xgr = self._xgr()
        self._overdue = [t for t in self._overdue if t.is_alive()]
        if len(self._overdue) >= MAX_OVERDUE:
            raise GrammarBusy(f"structured_outputs.{params.kind}: not compiled: {len(self._overdue)} earlier "
                              "constraints are still compiling past their deadline")
        result: dict = {}

        def work():
            try:
                result["grammar"] = self._compile_now(xgr, params)
            except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses with the parser's message
                result["error"] = exc

        # not a daemon: a thread still in xgrammar's C++ when the interpreter finalizes aborts it
        thread = threading.Thread(target=work, name="grammar-compile")
        thread.start()
        thread.join(self.compile_timeout_s)
        if thread.is_alive():
            self._overdue.append(thread)
            raise ConstraintError(f"structured_outputs.{params.kind}: the grammar did not compile within "
                                  f"{self.compile_timeout_s:g} s (too complex)")
        if "error" in result:
            exc = result["error"]
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConstraintError(f"structured_outputs.{params.kind}: {first}") from None
        return result["grammar"]

    def _compile_now(self, xgr, params: StructuredOutputsParams):
        c = self._compiler
        if params.json is not None:
            return c.compile_grammar(json_schema_ebnf(xgr, params.json))
        if params.regex is not None:
            return c.compile_regex(params.regex)
        if params.choice is not None:
            alternatives = " | ".join(map(ebnf_literal, params.choice))
            return c.compile_grammar(f"root ::= {alternatives}")
        if params.grammar is not None:
            return c.compile_grammar(params.grammar)
        return c.compile_grammar(json_schema_ebnf(xgr, {"type": "object"}))  # json_object: compact, like schemas

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
        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(max_threads=FILL_THREADS)
        self._batch.batch_fill_next_token_bitmask([seqs[i].matcher for i in local], mask, indices=local)
        apply_bitmask(logits, mask, local, self.vocab_size)

    @staticmethod
    def accept(seqs: list[Sequence]) -> list[Sequence]:
        """Feeds each constrained row its new token; returns the rows whose grammar is complete
        (their output is whole: they stop)."""
        live = [s for s in seqs if s.matcher is not None and s.finish_reason is None]
        if not live:
            return []
        import xgrammar

        tokens = [s.output_token_ids[-1] for s in live]
        accepted = xgrammar.BatchGrammarMatcher.batch_accept_token([s.matcher for s in live], tokens)
        for seq, token, ok in zip(live, tokens, accepted):
            if not ok:
                log.warning("grammar rejected token %d of request %d", token, seq.index)
        return [s for s in live if s.matcher.is_terminated()]

    @staticmethod
    def stop_whole_at_length(seqs: list[Sequence]) -> None:
        """Constrained rows that reached max_tokens on a token that completes their grammar are
        whole: they stop ("stop"), though the EOS that would have ended them was not drawn. Any other constrained row at max_tokens keeps "length", so
        "length" on a constrained row always means its output is incomplete."""
        for seq in seqs:
            m = seq.matcher
            if m is None or seq.finish_reason != "length" or not seq.output_token_ids:
                continue
            if m.accept_token(seq.output_token_ids[-1]) and m.is_completed():  # whole, EOS not drawn yet
                seq.finish("stop")


BYTE_BIAS = torch.where(((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool(), 0.0, float("-inf"))
"""(256, 8) float32: for each byte of a bitmask, what its 8 tokens' logits get added (0 allowed, -inf not)."""


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor, rows: list[int], vocab_size: int) -> None:
    """Sets to -inf, in place, the logits of batch rows `rows` that bitmask rows `rows` forbid
    (and any column past the grammar's `vocab_size`). logits (B, V); mask (B, ceil(vocab/32))
    int32 on the host, bit t of a row allowing token t.

    On CPU the mask becomes an additive bias of 0 and -inf, read per mask byte from BYTE_BIAS,
    then added to the rows: no per-token branch, about 4x faster than xgrammar's CPU kernel on a
    (64, 32000) batch. Elsewhere xgrammar's device kernel applies it."""
    if logits.device.type != "cpu":
        import xgrammar

        xgrammar.apply_token_bitmask_inplace(logits, mask.to(logits.device, non_blocking=True), indices=rows)
        return
    every = len(rows) == logits.shape[0]  # rows ascend, so they are 0..B-1
    picked = mask if every else mask[rows]
    bias = BYTE_BIAS.index_select(0, picked.view(torch.uint8).reshape(-1).to(torch.int64)).view(len(rows), -1)
    width = min(vocab_size, logits.shape[1])
    bias = bias[:, :width].to(logits.dtype)
    if width < logits.shape[1]:  # a padded LM head: its extra columns are no token of the grammar
        bias = torch.cat([bias, bias.new_full((len(rows), logits.shape[1] - width), float("-inf"))], dim=1)
    with torch.inference_mode():  # the forward pass's logits are inference tensors
        if every:
            logits.add_(bias)
        else:
            logits.index_add_(0, torch.tensor(rows, dtype=torch.int64), bias)
