"""Ray for a job: connected or started once, Ray Data's own progress bars and logs off, and the
one-line cause of a failure that Ray wrapped."""
from __future__ import annotations

import logging
import os
import re

from engine.api import one_line
from pipeline.errors import FatalShardError, InputError

FATAL_ERRORS = (FatalShardError, InputError)
"""Exceptions raised in a Ray task or actor whose message is the job's one-line cause."""


def ensure_ray(address: str | None, log_to_driver: bool = True) -> None:
    """Connects to the cluster at `address` (or RAY_ADDRESS), else starts a local Ray, unless Ray is
    initialised already. `log_to_driver`: print the workers' output here (Ray's default); off,
    it stays in the Ray session's log files."""
    import ray

    if ray.is_initialized():
        return
    quiet = dict(logging_level=logging.WARNING, log_to_driver=log_to_driver)
    if address or os.environ.get("RAY_ADDRESS"):  # `ray job submit` sets RAY_ADDRESS for the driver
        ray.init(address=address, **quiet)
    else:
        ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, **quiet)  # a fresh local Ray, sized to this machine


def quiet_ray_data() -> None:
    """Ray Data's own progress bars and per-dataset logs off: the job reports its own progress
    (pipeline.run.reporting.progress), and two bars never draw at once."""
    import ray

    logging.getLogger("ray.data").setLevel(logging.WARNING)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    ctx.enable_auto_log_stats = False
    detectors = getattr(ctx, "issue_detectors_config", None)
    if detectors is not None:  # per-actor memory advice is noise for a model-sized actor
        detectors.high_memory_detector_config.detection_time_interval_s = -1


def worker_cause(exc: BaseException) -> str:
    """The cause of a worker failure that Ray wrapped (RayTaskError, UserCodeException). Ray
    ships the remote exception as text inside the wrapper, so the cause is looked up there."""
    chain, seen = [], set()
    while isinstance(exc, BaseException) and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        exc = getattr(exc, "cause", None) or exc.__cause__
    for item in chain:
        if isinstance(item, FATAL_ERRORS):
            return str(item)
        for cls in FATAL_ERRORS:
            found = re.search(rf"{cls.__name__}: (.+)", str(item))
            if found:
                return found.group(1).strip()
    for item in chain:
        found = re.findall(r"^(\w+(?:Error|Exception): .+)$", str(item), flags=re.M)
        if found:
            return f"a worker failed: {found[-1].strip()}"
    return f"a worker failed: {one_line(chain[-1])}"
