"""Progress of a running job: plain lines (logs, cron, `ray job submit`) or a live bar (terminal).

The runner calls the reporter with messages, then `start`, `shard_done` per committed shard and
`close`. Ray Data's own progress bars stay off in jobs, so that only one of them ever draws.
"""
from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from pipeline.io import RunRecord


class Progress:
    """Plain lines: one per message and one per committed shard."""

    def __init__(self, write: Callable[[str], None] | None = None):
        self.write = write or (lambda text: print(text, file=sys.stderr, flush=True))
        self.shards = self.done = 0
        self.started = time.time()
        self.total_bytes: int | None = None
        self.done_bytes = self.new_bytes = 0

    def __call__(self, message: str) -> None:
        self.write(message)

    def start(self, shards: int | None, rows: int | None, total_bytes: int | None = None) -> None:
        """Generation begins: `shards` shards holding about `rows` rows (JSONL: lines) to run;
        None where the plan is still streaming in. Then `total_bytes`, the input's size from
        its listing, measures progress and gives the ETA (each shard reports its bytes)."""
        self.shards, self.done, self.started = shards, 0, time.time()
        self.total_bytes, self.done_bytes, self.new_bytes = total_bytes or None, 0, 0

    def shard_done(self, run: RunRecord, planned_rows: int, earlier: int = 0, nbytes: int = 0,
                   new: bool = True) -> None:
        """A shard of `planned_rows` rows and `nbytes` input bytes was committed by this run
        (`new`), or found committed by an earlier one (`earlier` such shards so far); `run`
        holds this run's counts so far."""
        self._count(nbytes, new)
        of = f"/{self.shards}" if self.shards else ""
        before = f", {earlier} committed earlier" if earlier else ""
        self.write(f"[{self.done}{of} shards{before}] {run.rows} rows, {run.errors} errors, "
                   f"{run.generated_tokens} tokens, {self.tokens_per_s(run):.1f} tok/s{self._share()}")

    def _count(self, nbytes: int, new: bool) -> None:
        self.done += 1
        self.done_bytes += nbytes
        self.new_bytes += nbytes if new else 0

    def tokens_per_s(self, run: RunRecord) -> float:
        return run.generated_tokens / max(time.time() - self.started, 1e-9)

    def eta_s(self) -> float | None:
        """Seconds left at this run's rate over the input bytes still to do; None if unknown."""
        if not self.total_bytes or not self.new_bytes:
            return None
        left = max(self.total_bytes - self.done_bytes, 0)
        return left * (time.time() - self.started) / self.new_bytes

    def _share(self) -> str:
        """', 42% of input, ETA 3m05s' where the input's size is known."""
        if not self.total_bytes:
            return ""
        eta = self.eta_s()
        return (f", {min(100.0, 100 * self.done_bytes / self.total_bytes):.0f}% of input"
                + (f", ETA {_duration(eta)}" if eta is not None else ""))

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

    def start(self, shards: int | None, rows: int | None, total_bytes: int | None = None) -> None:
        from tqdm import tqdm

        super().start(shards, rows, total_bytes)
        if rows:  # a known plan: the bar counts rows
            fmt = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} rows [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
            total = rows
        elif self.total_bytes:  # a streamed plan: the bar counts input bytes; the ETA is this run's
            fmt = "{desc}: {percentage:3.0f}%|{bar}| [{elapsed}{postfix}]"
            total = self.total_bytes
        else:
            fmt, total = "{desc}: {n_fmt} rows [{elapsed}, {rate_fmt}{postfix}]", None
        self.bar = tqdm(total=total, unit="row", desc="generating", file=self.stream, dynamic_ncols=True,
                        bar_format=fmt)

    def shard_done(self, run: RunRecord, planned_rows: int, earlier: int = 0, nbytes: int = 0,
                   new: bool = True) -> None:
        self._count(nbytes, new)
        of = f"/{self.shards}" if self.shards else ""
        if self.bar.total and not self.shards:  # a byte bar
            eta = self.eta_s()
            rate = run.rows / max(time.time() - self.started, 1e-9)
            self.bar.set_postfix_str(f"ETA {_duration(eta) if eta is not None else '?'}, {run.rows} rows, "
                                     f"{rate:.1f} row/s, {self.tokens_per_s(run):.1f} tok/s, {run.errors} errors, "
                                     f"{self.done} shards", refresh=False)
            self.bar.update(nbytes)
            return
        self.bar.set_postfix_str(f"{self.tokens_per_s(run):.1f} tok/s, {run.errors} errors, "
                                 f"{self.done}{of} shards", refresh=False)
        self.bar.update(planned_rows)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _duration(seconds: float) -> str:
    """3h05m, 4m10s, 12s."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def as_progress(progress) -> Progress:
    """A Progress from what run_job was given: a Progress, a plain `message -> None` callable, or None."""
    if isinstance(progress, Progress):
        return progress
    return Progress(progress)
