"""Progress of a running job: plain lines (logs, cron, `ray job submit`) or a live bar (terminal).

The runner calls the reporter with messages, then `start`, `shard_done` per committed shard and
`close`. Ray Data's own progress bars stay off in jobs, so that only one of them ever draws.
"""
from __future__ import annotations

import sys
import time
from typing import Callable


class Progress:
    """Plain lines: one per message and one per committed shard."""

    def __init__(self, write: Callable[[str], None] | None = None):
        self.write = write or (lambda text: print(text, file=sys.stderr, flush=True))
        self.shards = self.done = 0
        self.started = time.time()

    def __call__(self, message: str) -> None:
        self.write(message)

    def start(self, shards: int | None, rows: int | None) -> None:
        """Generation begins: `shards` shards holding about `rows` rows (JSONL: lines) to run;
        None where the plan is still streaming in (no total, no ETA)."""
        self.shards, self.done, self.started = shards, 0, time.time()

    def shard_done(self, run: dict, planned_rows: int, earlier: int = 0) -> None:
        """A shard of `planned_rows` rows was committed (by this run, or by an earlier one:
        `earlier` such shards so far); `run` holds this run's counts so far."""
        self.done += 1
        of = f"/{self.shards}" if self.shards else ""
        before = f", {earlier} committed earlier" if earlier else ""
        self.write(f"[{self.done}{of} shards{before}] {run['rows']} rows, {run['errors']} errors, "
                   f"{run['generated_tokens']} tokens, {self.tokens_per_s(run):.1f} tok/s")

    def tokens_per_s(self, run: dict) -> float:
        return run["generated_tokens"] / max(time.time() - self.started, 1e-9)

    def close(self) -> None:
        pass


class ProgressBar(Progress):
    """A live bar on a terminal: rows done of rows to run, rows/s, ETA, tokens/s and errors.
    Messages are printed above it."""

    def __init__(self, stream, write: Callable[[str], None] | None = None):
        super().__init__(write)
        self.stream, self.bar = stream, None

    def __call__(self, message: str) -> None:
        if self.bar is None:
            return super().__call__(message)
        with self.bar.external_write_mode(file=self.stream):  # clears the bar, redraws it after
            self.write(message)

    def start(self, shards: int, rows: int) -> None:
        from tqdm import tqdm

        super().start(shards, rows)
        fmt = ("{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} rows [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
               if rows else "{desc}: {n_fmt} rows [{elapsed}, {rate_fmt}{postfix}]")  # a streamed plan: no total
        self.bar = tqdm(total=rows or None, unit="row", desc="generating", file=self.stream, dynamic_ncols=True,
                        bar_format=fmt)

    def shard_done(self, run: dict, planned_rows: int, earlier: int = 0) -> None:
        self.done += 1
        of = f"/{self.shards}" if self.shards else ""
        self.bar.set_postfix_str(f"{self.tokens_per_s(run):.1f} tok/s, {run['errors']} errors, "
                                 f"{self.done}{of} shards", refresh=False)
        self.bar.update(planned_rows)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def as_progress(progress) -> Progress:
    """A Progress from what run_job was given: a Progress, a plain `message -> None` callable, or None."""
    if isinstance(progress, Progress):
        return progress
    return Progress(progress)
