"""The engine's structured outputs: each constraint routed to a backend (engine.structured.keywords),
compiled once (cached by its text), one matcher per constrained row, one token bitmask per step
filled by each backend for its rows and applied to the logits on the device before sampling, and
every finished constrained output checked (engine.structured.check).

Constraints may come from untrusted input (OpenAI Batch bodies), so what one can cost is bounded:
a grammar is compiled in a thread with a deadline (both backends compile in native code that
releases the GIL; a 113-byte schema with a nested repetition in a `pattern` takes xgrammar 8 s at
a 32k vocabulary), compiled grammars sit in an LRU cache bounded in entries and bytes, and a
constraint that failed (invalid, or over the deadline) is remembered, so its next rows fail at
once. A compile past its deadline cannot be stopped: it finishes in its thread (the process waits
for it at exit) and its result is dropped; while MAX_OVERDUE such compiles still run, new
constraints are refused, so overdue work and its memory stay bounded.
"""
from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace

import torch

from engine.api.errors import ConstraintError, GrammarBusy
from engine.api.structured_outputs import StructuredOutputsParams
from engine.core.sequence import Sequence
from engine.structured.bitmask import apply_bitmask
from engine.structured.check import OutputCheck
from engine.structured.guidance_backend import Guidance
from engine.structured.keywords import Route, route
from engine.structured.xgrammar_backend import XGrammar

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
"""Most compiles past their deadline that may still run; while they do, new constraints fail."""
TOO_COMPLEX = "(too complex)"
"""How the error of a compile past its deadline ends (the other backend is not tried then)."""

NATIVE_PREFIX = re.compile(r"^\s*(\[\d{1,2}:\d{2}:\d{2}\]\s+)?(\S+\.(cc|cpp|h|rs):\d+:\s*)?")
"""What a native library puts before its message: xgrammar's timestamp and C++ source path."""


def one_line_cause(exc: BaseException) -> str:
    """A backend's error as one line in the project's words: no timestamp, source path or banner."""
    lines = [NATIVE_PREFIX.sub("", line).strip() for line in str(exc).strip().splitlines()]
    lines = [line for line in lines if line and not set(line) <= set("^ ")]
    text = "; ".join(lines[:3]) if lines else type(exc).__name__
    text = text.removeprefix("Warning: ").removeprefix("error: ")
    return text if len(text) <= 300 else text[:297] + "..."


@dataclass
class Compiled:
    """A constraint ready to run: its backend, the backend's grammar, and its check."""

    route: Route
    backend: object
    grammar: object
    check: OutputCheck

    @property
    def size(self) -> int:
        return self.backend.size(self.grammar)


def _output_check(params: StructuredOutputsParams) -> OutputCheck:
    """The constraint's check; anything it raises on a hostile constraint is a ConstraintError."""
    try:
        return OutputCheck(params)
    except ConstraintError:
        raise
    except Exception as exc:  # noqa: BLE001  a constraint is row input: never the batch's exception
        raise ConstraintError(f"structured_outputs.{params.kind}: {one_line_cause(exc)}") from None


class RowMatcher:
    """A constrained row's matcher, with the backend that steps it and its constraint's check."""

    __slots__ = ("compiled", "native")

    def __init__(self, compiled: Compiled):
        self.compiled = compiled
        self.native = compiled.backend.matcher(compiled.grammar)

    @property
    def backend(self):
        return self.compiled.backend


class GrammarBackend:
    """Compiles constraints for one engine's tokenizer and vocabulary, steps their matchers, and
    checks their finished outputs. `backend`: EngineConfig.structured_outputs_backend."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: set[int],
                 compile_timeout_s: float = COMPILE_TIMEOUT_S, backend: str = "auto", paths=None):
        self.hf_tokenizer = hf_tokenizer
        self.paths = paths
        """The engine's fast paths (engine.runner.fast_paths): the device bitmask kernel is checked there."""
        self.vocab_size = vocab_size
        self.requested = backend
        route(None, backend)  # a bad name fails here
        stops = sorted(stop_token_ids)
        self.backends = {"xgrammar": XGrammar(hf_tokenizer, vocab_size, stops),
                         "guidance": Guidance(hf_tokenizer, vocab_size, stops)}
        self._guidance_unavailable: str | None | bool = False  # False: not asked yet
        self.compile_timeout_s = compile_timeout_s
        """Deadline of one compile, in seconds."""
        self._compiled: OrderedDict[str, Compiled] = OrderedDict()
        self._failed: OrderedDict[str, str] = OrderedDict()
        self._overdue: list[threading.Thread] = []
        self._bitmask: torch.Tensor | None = None

    @property
    def guidance_unavailable(self) -> str | None:
        """Why llguidance cannot run for this engine's tokenizer (None: it can); asked once."""
        if self._guidance_unavailable is False:
            self._guidance_unavailable = Guidance.unavailable(self.hf_tokenizer)
        return self._guidance_unavailable

    @property
    def cached_bytes(self) -> int:
        """Bytes of the compiled grammars in the cache."""
        return sum(c.size for c in self._compiled.values())

    def route(self, params: StructuredOutputsParams) -> Route:
        """The backend `params` runs on and what it leaves to the check after generation."""
        chosen = route(params.json if params.kind == "json" else None, self.requested,
                       guidance_ok=self.guidance_unavailable is None)
        if chosen.backend == "guidance" and self.guidance_unavailable:
            raise ConstraintError(f"structured_outputs_backend guidance: {self.guidance_unavailable}")
        return chosen

    def compile(self, params: StructuredOutputsParams) -> Compiled:
        """The compiled constraint of `params` (cached); ConstraintError naming the cause if it is
        invalid or does not compile within `compile_timeout_s`."""
        key = params.key()
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return self._compiled[key]
        if key in self._failed:
            self._failed.move_to_end(key)
            raise ConstraintError(self._failed[key])
        try:
            check = _output_check(params)
            chosen = self.route(params)
            try:
                grammar = self._compile_within_deadline(self.backends[chosen.backend], params)
            except ConstraintError as exc:
                chosen, grammar = self._other_backend(params, chosen, exc)
            compiled = Compiled(chosen, self.backends[chosen.backend], grammar, check)
        except GrammarBusy:
            raise  # not the constraint's fault: a later row may compile it
        except ConstraintError as exc:
            self._remember(self._failed, key, str(exc), FAILED_ENTRIES)
            raise
        self._remember(self._compiled, key, compiled, CACHE_ENTRIES)
        while len(self._compiled) > 1 and self.cached_bytes > CACHE_BYTES:
            self._compiled.popitem(last=False)
        return compiled

    def _other_backend(self, params: StructuredOutputsParams, chosen: Route, exc: ConstraintError):
        """With `auto`, a constraint the picked backend refused (not one that timed out) goes to the
        other: (its route, its grammar). Re-raises `exc` when that is not to be tried or fails too."""
        other = "guidance" if chosen.backend == "xgrammar" else "xgrammar"
        if self.requested != "auto" or isinstance(exc, GrammarBusy) or str(exc).endswith(TOO_COMPLEX) \
                or (other == "guidance" and self.guidance_unavailable):
            raise exc
        try:
            grammar = self._compile_within_deadline(self.backends[other], params)
        except ConstraintError:
            raise exc from None
        why = str(exc).removeprefix(f"structured_outputs.{params.kind}: ")
        return replace(route(params.json if params.kind == "json" else None, other), refused=why), grammar

    @staticmethod
    def _remember(cache: OrderedDict, key: str, value, limit: int) -> None:
        cache[key] = value
        while len(cache) > limit:
            cache.popitem(last=False)

    def _compile_within_deadline(self, backend, params: StructuredOutputsParams):
        self._overdue = [t for t in self._overdue if t.is_alive()]
        if len(self._overdue) >= MAX_OVERDUE:
            raise GrammarBusy(f"structured_outputs.{params.kind}: not compiled: {len(self._overdue)} earlier "
                              "constraints are still compiling past their deadline")
        result: dict = {}

        def work():
            try:
                result["grammar"] = backend.compile(params)
            except Exception as exc:  # the backends raise RuntimeError/ValueError subclasses with the parser's message
                result["error"] = exc

        # not a daemon: a thread still in native code when the interpreter finalizes aborts it
        thread = threading.Thread(target=work, name="grammar-compile")
        thread.start()
        thread.join(self.compile_timeout_s)
        if thread.is_alive():
            self._overdue.append(thread)
            raise ConstraintError(f"structured_outputs.{params.kind}: the grammar did not compile within "
                                  f"{self.compile_timeout_s:g} s {TOO_COMPLEX}")
        if "error" in result:
            exc = result["error"]
            if isinstance(exc, ConstraintError):
                raise exc
            raise ConstraintError(f"structured_outputs.{params.kind}: {one_line_cause(exc)}") from None
        return result["grammar"]

    def start(self, seq: Sequence) -> None:
        """Gives a constrained row its matcher (advanced over any output it already has)."""
        matcher = RowMatcher(self.compile(seq.params.structured_outputs))
        for token in seq.output_token_ids:
            matcher.backend.accept_one(matcher.native, token)
        seq.matcher = matcher

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Masks, in place, the tokens each constrained row's grammar forbids now. logits (B, V)."""
        local = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if not local:
            return
        rows = len(seqs)
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            self._bitmask = torch.full((max(rows, 8), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        mask = self._bitmask[:rows]
        for backend, idx in _by_backend(seqs, local):
            backend.fill([seqs[i].matcher.native for i in idx], mask, idx)
        apply_bitmask(logits, mask, local, self.vocab_size, self.paths)

    @staticmethod
    def accept(seqs: list[Sequence]) -> list[Sequence]:
        """Feeds each constrained row its new token; returns the rows whose grammar is complete
        (their output is whole: they stop)."""
        live = [s for s in seqs if s.matcher is not None and s.finish_reason is None]
        for backend, idx in _by_backend(live, range(len(live))):
            tokens = [live[i].output_token_ids[-1] for i in idx]
            accepted = backend.accept([live[i].matcher.native for i in idx], tokens)
            for i, token, ok in zip(idx, tokens, accepted):
                if not ok:
                    log.warning("grammar rejected token %d of request %d", token, live[i].index)
        return [s for s in live if s.matcher.backend.terminated(s.matcher.native)]

    @staticmethod
    def stop_whole_at_length(seqs: list[Sequence]) -> None:
        """Constrained rows that reached max_tokens on a token that completes their grammar are
        whole: they stop ("stop"), though the EOS that would have ended them was not drawn. Any
        other constrained row at max_tokens keeps "length", so "length" on a constrained row
        always means its output is incomplete."""
        for seq in seqs:
            m = seq.matcher
            if m is None or seq.finish_reason != "length" or not seq.output_token_ids:
                continue
            if m.backend.accept_one(m.native, seq.output_token_ids[-1]) and m.backend.accepting(m.native):
                seq.finish("stop")

    @staticmethod
    def check(seqs: list[Sequence]) -> None:
        """Sets the error of each finished constrained row ("stop") whose output breaks its
        constraint; its finish_reason stays."""
        for seq in seqs:
            m = seq.matcher
            if m is None or seq.finish_reason != "stop" or seq.error is not None:
                continue
            seq.error = m.compiled.check.violation(seq.text or "", m.backend.accepting(m.native))


def _by_backend(seqs: list[Sequence], indices):
    """(backend, [index, ...]) for each backend among the rows at `indices`, in order."""
    groups: dict[int, tuple[object, list[int]]] = {}
    for i in indices:
        backend = seqs[i].matcher.backend
        groups.setdefault(id(backend), (backend, []))[1].append(i)
    return list(groups.values())
