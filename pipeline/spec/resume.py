"""Whether an output an earlier version wrote holds the rows a spec computes, by the spec its
_job.json recorded: so a field that stopped counting (TUNED_FIELDS) may change on a resume."""
from __future__ import annotations

from pydantic import ValidationError

from pipeline.errors import SpecError
from pipeline.spec.fingerprint import fingerprint
from pipeline.spec.schema import JobSpec


def resumes(spec: JobSpec, recorded: dict | None) -> bool:
    """Whether an output whose _job.json recorded the spec `recorded` (as JSON, with its
    fingerprint) holds the rows `spec` computes: the two fingerprints agree under this version's
    rules. So an output written before a field stopped counting resumes with that field changed."""
    if not isinstance(recorded, dict):
        return False
    try:
        earlier = JobSpec.model_validate({k: v for k, v in recorded.items() if k != "fingerprint"})
        return fingerprint(earlier) == fingerprint(spec)
    except (ValidationError, SpecError, ValueError, TypeError):
        return False
