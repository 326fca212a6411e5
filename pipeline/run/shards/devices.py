"""Where a job's engines compute when the spec leaves it to batchinfer (engine.device auto with
workers.gpus unset): on GPUs, one per tensor-parallel rank, where the Ray cluster has GPUs (or an
autoscaler may add nodes with them); on CPU, the ranks over gloo, where it has none.

A resumed output generated on CPU stays there: auto would compute other rows on GPUs (bfloat16),
and an output holds rows of one kind (pipeline.run.driver refuses a resume that changes them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline.run.shards.resources import alive_nodes, node_groups

if TYPE_CHECKING:
    from pipeline.spec import JobSpec


def picks_devices(spec: JobSpec) -> bool:
    """Whether batchinfer picks the actors' devices (engine.device auto, workers.gpus unset)."""
    return spec.engine.device == "auto" and "gpus" not in spec.workers.model_fields_set


@dataclass(frozen=True)
class DeviceChoice:
    gpus: float
    """GPUs per engine actor (0: CPU)."""
    line: str
    """The preflight line that names the choice."""
    resolved: bool
    """Whether batchinfer chose (engine.device auto, workers.gpus unset) rather than the spec."""


def choose_devices(spec: JobSpec, nodes: list[dict[str, float]], groups: list[dict[str, float]],
                   keep_cpu: bool = False) -> DeviceChoice:
    """The devices of `spec`'s actors on a cluster of `nodes` (resources per alive node) whose
    autoscaler may add `groups`; `keep_cpu`: the output being resumed was generated on CPU."""
    n, workers = spec.engine.tensor_parallel_size, spec.workers
    ranks = f"{n} tensor-parallel ranks" if n > 1 else "its one rank"
    if not picks_devices(spec):
        where = f"{workers.gpus:g} GPUs per engine actor" if workers.gpus else "CPU"
        return DeviceChoice(workers.gpus, f"devices: {where} (engine.device {spec.engine.device}, "
                                          f"workers.gpus {workers.gpus:g})", False)
    most = max((node.get("GPU", 0.0) for node in [*nodes, *groups]), default=0.0)
    if most <= 0:
        gloo = " over gloo" if n > 1 else ""
        return DeviceChoice(0.0, f"devices: the Ray cluster has no GPUs: each engine actor runs {ranks} on CPU{gloo} "
                                 "(engine.device auto)", True)
    if keep_cpu:
        return DeviceChoice(0.0, "devices: the output was generated on CPU: its resume stays on CPU although the Ray "
                                 "cluster has GPUs (set workers.gpus and --overwrite to start afresh on GPUs)", True)
    return DeviceChoice(float(n), f"devices: the Ray cluster has GPUs: each engine actor asks for {n} GPU"
                                  f"{'s, one per tensor-parallel rank' if n > 1 else ''} (engine.device auto; "
                                  "set workers.gpus: 0 to run on CPU)", True)


def resolve_devices(spec: JobSpec, keep_cpu: bool = False) -> DeviceChoice:
    """Chooses for `spec` on the connected Ray cluster and sets workers.gpus to the choice."""
    import ray

    choice = choose_devices(spec, alive_nodes(ray), node_groups(), keep_cpu)
    if choice.resolved:
        spec.workers.gpus = choice.gpus
    return choice
