"""A command's terminal: batchinfer's own lines only, everything else in a log file.

Ray and the libraries under it write to the terminal in three ways; while a command runs, each
is sent to the log file instead (`--verbose` leaves them all as they are):
  - Python's sys.stderr, which Ray's log handlers ("ray", "ray.data") look up when they write,
    and where Python warnings go: it is the log file (a warning raised in engine/, pipeline/ or
    jobs/ is ours and still reaches the terminal);
  - file descriptor 2, which Ray's C++ core worker writes to: it is pointed at the log file too;
  - worker processes' output, which Ray forwards to the driver: not forwarded at all
    (`log_to_driver` off, see pipeline.run.shards.ray_env); it stays in Ray's session logs, and a failed
    shard's cause comes back as the job's one-line error.
batchinfer's lines go to `terminal()`: the stderr the command started with.
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
import warnings
from pathlib import Path

_OUR_DIRS = tuple(str(Path(__file__).resolve().parents[1] / name) + os.sep for name in ("engine", "pipeline", "jobs"))

_active: QuietTerminal | None = None


def terminal():
    """Where batchinfer's own stderr lines go: the stderr of the command running, else sys.stderr."""
    return _active.terminal if _active is not None and _active.terminal is not None else sys.stderr


class QuietTerminal:
    """`with QuietTerminal(verbose, stderr) as quiet:` around one command; `stderr` is the command's
    own stream (default sys.stderr). `quiet.path` is the log file (None when verbose). The file is
    removed when the block ends without an error, unless `keep` is set."""

    def __init__(self, verbose: bool = False, stderr=None):
        self.verbose = verbose
        self.stderr = stderr
        self.path: str | None = None
        """The log file."""
        self.terminal = None
        """The stream of batchinfer's lines while the block runs."""
        self.keep = False
        """Keep the log file (a command that failed without raising sets it)."""
        self._undo = contextlib.ExitStack()

    def __enter__(self) -> QuietTerminal:
        global _active
        stream = self.stderr or sys.stderr
        previous, _active = _active, self
        self._undo.callback(globals().__setitem__, "_active", previous)
        if self.verbose:
            self.terminal = stream
            return self
        fd, self.path = tempfile.mkstemp(prefix="batchinfer-", suffix=".log")
        log = os.fdopen(fd, "w", buffering=1, encoding="utf-8", errors="replace")
        self._undo.callback(log.close)
        self.terminal = self._point_fd2_at(log, stream)
        before = sys.stderr
        sys.stderr = log
        self._undo.callback(setattr, sys, "stderr", before)
        self._route_warnings(log)
        return self

    def __exit__(self, kind, exc, tb) -> None:
        self._undo.close()
        failed = kind is not None and not (issubclass(kind, SystemExit) and exc.code in (0, None))
        if self.path and not (failed or self.keep):
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    def logged(self) -> bool:
        """Whether anything was written to the log file so far."""
        if self.path is None:
            return False
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        return os.path.getsize(self.path) > 0

    def _point_fd2_at(self, log, stream):
        """Points descriptor 2 at `log`; returns a stream to the terminal that `stream` was."""
        try:
            stream.flush()
            saved = os.dup(2)
        except (OSError, ValueError):  # no descriptor 2: nothing low-level can reach a terminal
            return stream
        os.dup2(log.fileno(), 2)
        self._undo.callback(os.close, saved)
        self._undo.callback(os.dup2, saved, 2)
        if not _writes_to_fd(stream, 2):  # a test runner's buffer: it stays batchinfer's stream
            return stream
        own = io.TextIOWrapper(os.fdopen(os.dup(saved), "wb", buffering=0), encoding=stream.encoding,
                               errors="replace", line_buffering=True)
        self._undo.callback(own.close)
        return own

    def _route_warnings(self, log) -> None:
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            ours = str(filename).startswith(_OUR_DIRS)
            (terminal() if ours else log).write(warnings.formatwarning(message, category, filename, lineno, line))

        warnings.showwarning = show
        self._undo.callback(setattr, warnings, "showwarning", shown)


def _writes_to_fd(stream, fd: int) -> bool:
    try:
        return stream.fileno() == fd
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return False
