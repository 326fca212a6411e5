"""Every exception the engine raises, in one place. Each says whether a retry can help.

A problem with one request (an empty prompt, a prompt too long, a constraint that does not
compile) ends that request with finish_reason "error" and its message; the other requests go
on. The exceptions below are what stops a call or an engine. `one_line` shortens any of them
for a report.
"""
from __future__ import annotations


class EngineError(RuntimeError):
    """Base of the engine's own exceptions, each a RuntimeError; whether a retry can help, each
    subclass says."""


class ModelLoadError(EngineError):
    """The model cannot be loaded (missing, not a model, pickle-only weights, an architecture or
    a quantization the engine cannot run); the message says why in one line. A retry helps only
    when the cause was passing (the Hub or object storage unreachable); otherwise fix the model
    or the config."""


class DeviceError(EngineError):
    """The device asked for is not there (`device: cuda` where torch sees no CUDA device). A retry
    helps only on a machine that has it."""


class PoolSizingError(EngineError):
    """The KV pool cannot be sized from the card's memory (gpu_memory_utilization asks for more
    than was free, or leaves fewer KV tokens than max_model_len). A retry helps only once other
    processes free the card; otherwise lower or raise the setting the message names."""


class PoolExhausted(EngineError, MemoryError):
    """More KV blocks were asked of the pool than it has free: the scheduler admits rows only
    within the free blocks, so this is a bug of the engine's bookkeeping. A retry with a fresh
    engine can help: as a MemoryError, a job's worker redoes the shard with a smaller budget."""


class BatchFull(EngineError):
    """More rows joined the running table than it has slots (max_num_seqs): a bug of the
    scheduler's bookkeeping. A retry with a fresh engine can help."""


class RankError(EngineError):
    """A tensor-parallel rank process died, failed or timed out, and the engine has stopped all
    of its ranks. A retry with a fresh engine can help (a job's worker builds one and redoes the shard)."""


class EngineBusy(EngineError):
    """generate() or score_choices() was called while requests queued with add_request() still
    run. A retry helps once those are drained (step() until has_unfinished() is False)."""


class FastPathError(EngineError):
    """A fast path (a kernel, CUDA graphs, a quantized GEMM) failed its check against the torch
    reference while `strict_kernels` was set (otherwise the engine falls back to the reference
    with one warning), or a LoRA layer, which has no second path, failed its own. A retry does
    not help: run without strict_kernels, or fix the kernel or the driver it needs."""


class AttentionOutsideEngine(EngineError):
    """A model loaded with the engine's paged attention was run outside the engine (it has no KV
    pool to read). A retry cannot help: run it through LLMEngine, or load it anew with another
    attn_implementation."""


class ConstraintError(ValueError):
    """A structured-output constraint is invalid or did not compile within its deadline. Only its
    requests fail (their `error`); a retry of the same constraint fails the same way (one that
    timed out may compile on a less busy machine)."""


class RegexTimeout(Exception):
    """A regex of a finished output's check (a schema's `pattern`, a `regex` constraint) ran past
    the row's time bound. The check turns it into that row's violation; a retry of the same output
    runs past it the same way."""


class GrammarBusy(ConstraintError):
    """A constraint was not tried: too many earlier ones are still compiling past their deadline.
    A retry (a later request with it) can help, once they have finished."""


class AdapterError(ValueError):
    """A LoRA adapter cannot be used: missing or unreadable, a corrupt safetensors file, a rank above
    max_lora_rank, DoRA, a module the engine cannot adapt, another base model's shapes, or LoRA not
    enabled. Only the requests naming it fail (their `error`); a job's preflight raises it for an
    adapter its spec names. A retry helps only when the cause was passing (storage unreachable)."""


def one_line(exc: BaseException) -> str:
    """`Type: first line of the message`, for one-line error reports."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"

