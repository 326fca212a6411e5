"""What identifies a job's model, found by the driver before any actor starts
(engine.models.identity): recorded in the output's _job.json, and a resume whose model changed
since (a Hub revision that moved, a directory or an object-storage prefix rewritten) is refused
(pipeline.run.checks.claim.model_conflict)."""
from __future__ import annotations

from engine import ECHO_MODEL
from engine.api import ModelLoadError, one_line
from pipeline.errors import JobError
from pipeline.spec import JobSpec


def check_model_identity(spec: JobSpec) -> dict:
    """{"kind", "id"} of the spec's model; JobError in one line where it cannot be found."""
    if spec.model == ECHO_MODEL:
        return {"kind": "builtin", "id": ECHO_MODEL}  # without importing the engine
    from engine.models import model_identity

    try:
        return model_identity(spec.engine_config())
    except (ModelLoadError, OSError, ValueError) as exc:
        raise JobError(f"cannot identify the model {spec.model}: {one_line(exc)}") from None
