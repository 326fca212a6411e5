"""What an engine actor asks Ray for, and a preflight of that request against the cluster: never hang on it.

One engine actor asks for workers.cpus CPUs and workers.gpus GPUs on one node. On a fixed
cluster (a local Ray, or a cluster without an autoscaler) a request no node can hold fails at
once; with an autoscaler the job asks for one such node and waits up to
workers.resource_wait_s, then fails. Ray itself would wait forever ("The job may hang
forever"), which is the worst outcome for a cron job.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pipeline.errors import ResourceError

if TYPE_CHECKING:
    from pipeline.spec import WorkersSpec

POLL_S = 5.0


def actor_request(workers: WorkersSpec) -> dict[str, float]:
    """The resources one engine actor asks Ray for."""
    need = {"CPU": float(workers.cpus)}
    if workers.gpus:
        need["GPU"] = float(workers.gpus)
    return need


def engine_stage_args(workers: WorkersSpec, actors: int | None = None, env: dict | None = None) -> dict:
    """`map_batches` arguments of an engine stage (a job's shards, or a processor's rows): a fixed
    pool of `actors` actors (default workers.num), each asking for actor_request(workers). `env`:
    variables for the actors' runtime environment."""
    import ray

    need = actor_request(workers)
    args = {"compute": ray.data.ActorPoolStrategy(size=actors or workers.num), "num_cpus": need["CPU"],
            "num_gpus": need.get("GPU")}
    if env:
        args["runtime_env"] = {"env_vars": env}
    return args


def shortfall(need: dict[str, float], nodes: list[dict[str, float]]) -> tuple[str, float] | None:
    """None if some node can hold `need`, else (the first resource no node has enough of,
    the most of it on any one node)."""
    if any(all(node.get(k, 0.0) >= v for k, v in need.items()) for node in nodes):
        return None
    for key, value in need.items():
        most = max((node.get(key, 0.0) for node in nodes), default=0.0)
        if most < value:
            return key, most
    return next(iter(need)), 0.0  # each fits somewhere, never together on one node


def scalable(need: dict[str, float], node_groups: list[dict[str, float]]) -> bool:
    """Whether an autoscaler with these node types (resources per node) could add a node for `need`."""
    return any(all(group.get(k, 0.0) >= v for k, v in need.items()) for group in node_groups)


def describe(need: dict, missing: tuple[str, float], gpus_by: str = "workers.gpus") -> str:
    key, most = missing
    knob = {"CPU": "workers.cpus", "GPU": gpus_by}.get(key, key)
    if knob.startswith("workers."):
        knob = f"{knob}={need[key]:g}"
    return (f"{knob}: no node of the Ray cluster has {need[key]:g} {key} for one engine actor "
            f"(most on one node: {most:g})")


def check_resources(workers: WorkersSpec, progress=lambda message: None, gpus_by: str = "workers.gpus") -> None:
    """Raises ResourceError when one actor cannot be placed (Ray must be initialised). `gpus_by`:
    what set the GPUs it asks for, as the error names it."""
    import ray

    need = actor_request(workers)
    missing = shortfall(need, alive_nodes(ray))
    if missing is None:
        return
    groups = node_groups()
    if not scalable(need, groups):
        raise ResourceError(describe(need, missing, gpus_by) + "; lower it, or use a cluster that has such nodes")
    wait = workers.resource_wait_s
    progress(f"waiting up to {wait:g}s for the autoscaler to add a node with {need}")
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=[need])
    deadline = time.time() + wait
    while time.time() < deadline:
        time.sleep(min(POLL_S, max(deadline - time.time(), 0.0)))
        if shortfall(need, alive_nodes(ray)) is None:
            return
    raise ResourceError(describe(need, missing, gpus_by) + f" after waiting workers.resource_wait_s={wait:g}s "
                        "for the autoscaler")


def alive_nodes(ray) -> list[dict[str, float]]:
    return [node["Resources"] for node in ray.nodes() if node.get("Alive")]


def node_groups() -> list[dict[str, float]]:
    """Resources per node of each node type the autoscaler may still add; [] without one."""
    from ray._private.state import state  # the cluster config Ray Data's own autoscaling reads

    try:
        config = state.get_cluster_config()
    except Exception:  # noqa: BLE001  (no autoscaler state: a fixed cluster)
        return []
    if config is None:
        return []
    return [dict(group.resources) for group in config.node_group_configs if group.max_count != 0]
