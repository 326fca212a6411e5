"""A job's LoRA adapters before any actor starts: `lora.path` listed once into the spec's
`lora.adapters`, every adapter read and checked against the model (one fatal line naming it), and
its files' digest kept in the output's _job.json, so a resume with an adapter whose files changed
is refused while an adapter added to a lora.each job computes only its own rows."""
from __future__ import annotations

from dataclasses import replace
from typing import TypeVar

from engine.api import AdapterError, LoRARequest, ModelLoadError
from pipeline.errors import InputError, JobError
from pipeline.io import list_adapters
from pipeline.spec import Job, JobSpec, StageSpec

S = TypeVar("S", bound=StageSpec)


def listed_adapters(spec: S) -> S:
    """The spec (a job's or a processor's) with lora.path's adapters listed into lora.adapters."""
    lora = spec.lora
    if not lora.path:
        return spec
    try:
        adapters = list_adapters(lora.path, lora.adapters, lora.storage_options)
    except InputError as exc:
        raise JobError(str(exc)) from None
    return spec.model_copy(update={"lora": lora.model_copy(update={"adapters": adapters, "path": None})})


def with_adapters(job: Job) -> Job:
    """The job with lora.path's adapters listed into its spec's lora.adapters (once, by the driver)."""
    return replace(job, spec=listed_adapters(job.spec)) if job.spec.lora.path else job


def check_adapters(spec: JobSpec) -> dict[str, str]:
    """name -> sha256 of its files, for every adapter the spec names, each read and checked against the
    model's projections (shapes from its config, no weights loaded). JobError names a bad one."""
    if not spec.lora.active:
        return {}
    from engine.lora import read_adapter  # imports torch: only for a job with adapters
    from engine.models import check_model_files
    from engine.runner import adapter_targets

    config = spec.engine_config()
    try:
        targets = adapter_targets(config, check_model_files(config))
    except (ModelLoadError, ValueError) as exc:
        raise JobError(f"lora: cannot read the model's layers to check adapters against: {exc}") from None
    digests = {}
    for i, name in enumerate(sorted(spec.lora.adapters)):
        try:
            weights = read_adapter(LoRARequest(name, i + 1, spec.lora.adapters[name]), config, targets)
        except AdapterError as exc:
            raise JobError(f"lora.adapters.{name}: {exc}") from None
        digests[name] = weights.digest.hex()
    return digests


def adapters_conflict(path: str, was: dict[str, str] | None, now: dict[str, str]) -> str | None:
    """Why an output started with adapters `was` cannot resume with `now` (None: it can). Adding one is
    fine; changing or dropping one is not (its rows were computed from other files, or would be left)."""
    for name, digest in sorted((was or {}).items()):
        if name not in now:
            return (f"{path} holds rows of adapter {name}, which this spec no longer names: add it back, or use "
                    "--overwrite to start afresh")
        if now[name] != digest:
            return (f"{path}: adapter {name}'s files changed since its rows were written: use --overwrite to start "
                    "afresh (or give the changed adapter a new name)")
    return None
