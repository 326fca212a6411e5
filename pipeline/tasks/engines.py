"""The engine a task runs on: built for a spec (or a halved budget), its CPU threads shared among
a node's actors, and what counts as running out of memory."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from engine import ECHO_MODEL
from engine.api import EngineConfig
from pipeline.tasks.task_runner import TaskRunner

if TYPE_CHECKING:
    from engine import LLMEngine
    from pipeline.spec import JobSpec
    from pipeline.tasks.prompts import PromptBuilder

OOM_MARKERS = ("out of memory", "DefaultCPUAllocator")
"""Texts of allocation failures that torch raises as plain RuntimeErrors (host memory)."""


def start_engine(spec: JobSpec, prompts: PromptBuilder | None = None,
                 config: EngineConfig | None = None) -> tuple[LLMEngine, TaskRunner]:
    """The engine for `spec` (or for `config`, e.g. at a halved budget; its CPU threads shared
    among the node's actors) and its task runner."""
    config = config or spec.engine_config()
    if not spec.workers.gpus and config.model != ECHO_MODEL:  # the echo engine runs no torch
        share_cpu_threads(spec.workers.num)
    engine = build_engine(config)
    return engine, TaskRunner(spec, engine, prompts)


def build_engine(config: EngineConfig):
    """An engine: LLMEngine, or the instant EchoEngine for builtin:echo (scale tests)."""
    from engine import EchoEngine

    if config.model == ECHO_MODEL:
        return EchoEngine(config)
    from engine import LLMEngine  # the engine's modules import torch: only when one is built

    return LLMEngine(config)


def stop_engine(engine) -> None:
    """Stops an engine's rank processes (tensor_parallel_size > 1) before it is dropped."""
    close = getattr(engine, "close", None)
    if close is not None:
        close()


def is_out_of_memory(exc: BaseException) -> bool:
    """An allocation failure: torch.OutOfMemoryError (CUDA, MPS) or a host allocator's RuntimeError."""
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, (RuntimeError, MemoryError)) and (
        isinstance(exc, MemoryError) or any(m in str(exc) for m in OOM_MARKERS))


def empty_device_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def share_cpu_threads(num_workers: int) -> None:
    """Ray caps a fractional-CPU actor at one math thread (OMP_NUM_THREADS=1); on a CPU-only
    node the engines should share the cores instead."""
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // num_workers))


ENGINE_FACTS = ("device", "dtype", "quantization", "tensor_parallel_size", "weights_bytes", "kv_blocks", "block_size",
                "kv_bytes", "kv_cache_dtype", "max_num_batched_tokens", "load_peak_bytes")
"""What a part's record says about the engine that generated it (the manifest's `engines`)."""
RANK_FACTS = ("rank_weights_bytes", "rank_load_peak_bytes")
"""Added to those under tensor parallelism: each rank's weights' bytes and load peak, rank 0 first."""
GGUF_FACTS = ("file", "digest", "tensor_types")
FAST_PATHS_FACT = "fast_paths"
"""Added where the engine took a fast path: each one's state (engine.runner.fast_paths): checked, or fell back and why."""
"""Added, as `gguf`, for a model read from a GGUF file: the file's name, its sha256 and its tensor types."""


def engine_facts(engine) -> dict | None:
    """The resolved device, dtype and quantization of `engine`, its weights' bytes, its KV pool's
    blocks and bytes, its max_num_batched_tokens and what loading its weights added at the peak
    (None for an engine without them: echo)."""
    runner = getattr(engine, "runner", None)
    if runner is None or not hasattr(engine, "memory"):
        return None
    facts = {"device": str(runner.device), "dtype": str(runner.dtype).removeprefix("torch."),
             "max_num_batched_tokens": engine.max_num_batched_tokens, **engine.memory}
    out = {k: facts.get(k) for k in ENGINE_FACTS} | {k: facts[k] for k in RANK_FACTS if k in facts}
    from engine.models import gguf_source

    paths = getattr(runner, "paths", None)
    if paths is not None and paths.state:  # fast paths checked, and those that fell back
        out["fast_paths"] = paths.facts()
    source = gguf_source(getattr(runner, "model_dir", None) or "")
    if source is not None:
        out["gguf"] = {k: source.get(k) for k in GGUF_FACTS}
    return out
