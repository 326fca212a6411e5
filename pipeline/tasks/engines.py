"""The engine a task runs on: built for a spec (or a halved budget) by engine.build, its CPU threads
shared among a node's actors, and what counts as running out of memory."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from engine import build as build_engine
from engine.api import Engine, EngineConfig
from pipeline.tasks.task_runner import TaskRunner

if TYPE_CHECKING:
    from pipeline.spec import Stage, WorkersSpec
    from pipeline.tasks.prompts import PromptBuilder

OOM_MARKERS = ("out of memory", "DefaultCPUAllocator")
"""Texts of allocation failures that torch raises as plain RuntimeErrors (host memory)."""


def start_engine(stage: Stage, workers: WorkersSpec, prompts: PromptBuilder | None = None,
                 config: EngineConfig | None = None) -> tuple[Engine, TaskRunner]:
    """The engine for `stage` (or for `config`, e.g. at a halved budget; on a CPU-only node its torch
    threads shared among the `workers`' actors) and its task runner."""
    config = config or stage.spec.engine_config()
    engine = build_engine(config)  # engine.build: the engine protocol's builder
    if not workers.gpus and engine.facts().device == "cpu":  # the echo engine runs no torch
        share_cpu_threads(workers.num)
    return engine, TaskRunner(stage, engine, prompts)


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
