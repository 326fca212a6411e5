"""Scheduled runs (cron, Airflow): one command per schedule slot, with a dated output prefix.

A retry of the same slot reruns the same command: the job resumes where the failed attempt
stopped, and the run lock keeps two attempts from writing the output at once.
"""
from __future__ import annotations

import shlex


def dated_output(prefix: str, ds: str) -> str:
    """`s3://bucket/labels` + `2026-11-30` -> `s3://bucket/labels/2026-11-30/`."""
    return f"{prefix.rstrip('/')}/{ds}/"


def job_command(config: str, output_prefix: str, ds: str, python: str = "python",
                extra: list[str] | None = None) -> str:
    """The shell command that runs `config` for schedule slot `ds` (YYYY-MM-DD)."""
    args = [python, "-m", "jobs.run", config, "--set", f"output.path={dated_output(output_prefix, ds)}"]
    return shlex.join(args + list(extra or []))
