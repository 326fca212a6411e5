"""A job as the pipeline passes it around: the validated spec and what a run adds to it."""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.spec.schema import JobSpec, validate


@dataclass(frozen=True)
class Job:
    """One job, handed whole from the runner to its planning tasks and engine actors (Ray pickles it)."""

    spec: JobSpec
    """The validated spec."""
    fingerprint: str
    """Hash of what changes the output rows (`JobSpec.fingerprint()`); `_job.json` keeps it, so that a
    rerun with another spec on the same output is refused."""
    created: int | None = None
    """The job's creation time (Unix seconds), the same on every resume: set by the runner once the
    output is claimed; OpenAI Batch lines carry it. None outside a run (an actor then uses now)."""

    @classmethod
    def of(cls, spec: JobSpec) -> Job:
        return cls(spec, spec.fingerprint())

    @classmethod
    def from_dict(cls, data: dict) -> Job:
        """A job from the spec dict that `run_job` used to take: `JobSpec.model_dump()` plus its
        "fingerprint" (validated again here; the fingerprint is kept as given)."""
        fields = {k: v for k, v in data.items() if k not in ("fingerprint", "created")}
        spec = validate(fields)
        return cls(spec, data.get("fingerprint") or spec.fingerprint(), data.get("created"))
