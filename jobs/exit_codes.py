"""Exit codes of `batchinfer run` / `python -m jobs.run`, and what each means to a scheduler."""
from __future__ import annotations

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_ERROR_RATE = 0, 1, 2, 3

EXIT_CODES = {EXIT_OK: "done (or nothing to do)", EXIT_FAILED: "failed: retry resumes",
              EXIT_USAGE: "bad spec or usage: fix, do not retry",
              EXIT_ERROR_RATE: "error rate above max_error_rate: inspect the errors"}
"""What each exit code means to a scheduler (cron, Airflow)."""
