"""Every job-level exception of the pipeline, in one place. Each says whether a retry can help.

The message of each is its one-line cause, as the CLI prints it after `error: `. A per-row
problem is never one of these: it becomes that row's `error` and the job goes on.
"""
from __future__ import annotations


class JobError(RuntimeError):
    """A fatal problem: the job cannot run. A rerun resumes, so a retry helps when the cause was
    passing (storage down, a worker lost for good); otherwise it fails the same way."""


class OutputConflict(JobError):
    """The output path holds another job's output. A retry cannot help: use another output path,
    or --overwrite."""


class SpecError(ValueError):
    """The spec is invalid; the message names the bad key(s). A retry cannot help: fix the spec."""


class TemplateError(ValueError):
    """The prompt template itself is invalid (found before any actor starts). A retry cannot help."""


class InputError(RuntimeError):
    """The input cannot be used at all (missing, unreadable after retries, planned by a newer
    version). A retry helps only once the input is fixed."""


class LockHeld(RuntimeError):
    """Another live run holds the output's lock; the message names it. A retry helps once that run
    has ended or its heartbeat is stale."""


class LockLost(JobError):
    """This run's lock on the output was taken over by another run (its heartbeat could not be
    written for as long as a lock stays fresh: a storage outage, a paused process), so it stopped
    before committing more. Nothing committed is lost; a retry resumes once the other run has ended."""


class ResourceError(RuntimeError):
    """The engine actors cannot be placed on the Ray cluster; the message names the resource. A
    retry helps only on a cluster that has since grown."""


class FatalShardError(RuntimeError):
    """A shard that can never succeed (duplicate ids, a worker whose setup failed, out of memory at
    the smallest budget): the job must stop. A retry fails the same way."""
