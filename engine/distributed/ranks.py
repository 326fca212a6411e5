"""The rank processes of a tensor-parallel engine, started and watched by rank 0.

Rank 0 is the engine's own process: it tokenizes, schedules and samples. It starts ranks
1..N-1 as local processes (no Ray), forked from a multiprocessing fork server that imported the
engine once (`rank_context`; spawn where there is none, as vLLM's multiprocessing executor
does), and sends each of them every step's command over a pipe: the pass inputs of the model
runner (host arrays, pickled), or a KV pool to create, drop or copy a block in. Every rank then
runs the same forward pass on its shard, meeting the others in the all-reduces of
torch.distributed (gloo on CPU, NCCL on CUDA), each with `distributed_timeout_s`.

Commands travel over pipes rather than a broadcast so that an idle engine (no step for longer
than the timeout) never times out, and so that a rank learns of rank 0's death at once (the
pipe closes). A rank also polls its parent's pid, so it exits within POLL_S of rank 0 however
rank 0 died (a kill, an exception, Ctrl-C) even while stuck in a collective. Rank 0 checks its
ranks' liveness before every command; a rank that died, failed or hangs past the timeout
raises RankError (naming the rank, its pid and why) after every rank is stopped.
"""
from __future__ import annotations

import itertools
import multiprocessing
import os
import socket
import threading
import time
import weakref
from datetime import timedelta

import torch

from engine.api.errors import ModelLoadError, RankError, one_line

POLL_S = 0.2
"""How often a rank checks that rank 0 is alive, and rank 0 waits on its starting ranks."""
FAIL_WAIT_S = 0.5
"""How long rank 0, after a failed pass, waits for a failing rank to exit (so it can name it)."""
STOP_S = 5.0
"""How long close() waits for a rank to exit before killing it."""
PRELOAD = ("engine.runner.model_runner", "transformers.modeling_utils", "transformers.masking_utils")
"""What the fork server imports once, so that a rank starts without importing torch and
transformers again (~8 s of CPU a rank on a 2-core machine): every later engine's ranks, and a
restarted engine's, fork from it. The server itself never touches a device."""


RANK_NAME = "batchinfer-tp"
"""A rank's process name, followed by its rank (Linux)."""


def rank_context():
    """The multiprocessing context ranks start in: the fork server with PRELOAD imported, or
    spawn where the platform has no fork server. The server is started by the first rank started
    in this process and lives as long as the process does."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _rank_entry(rank_main, env: dict, config, rank: int, *args) -> None:
    """A rank's first code: its process name (`ps` shows batchinfer-tp1, ...), the environment
    rank 0 has now (the fork server keeps the one it started with), then
    rank_main(config, rank, *args)."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(f"{RANK_NAME}{rank}")
    except OSError:  # no /proc here
        pass
    os.environ.clear()
    os.environ.update(env)
    rank_main(config, rank, *args)


def backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_group(config, rank: int, port: int, device: torch.device) -> None:
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend(device), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=config.tensor_parallel_size,
                            timeout=timedelta(seconds=config.distributed_timeout_s))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankGroup:
    """Rank 0's handle on ranks 1..N-1."""

    def __init__(self, procs, conns, timeout_s: float, threads: int):
        self.procs = procs
        self.conns = conns
        self.timeout_s = timeout_s
        self._threads = threads  # rank 0's torch threads before the ranks shared the cores
        self._keys = itertools.count()
        self._finalizer = weakref.finalize(self, _stop, procs, conns, threads, STOP_S)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    @classmethod
    def start(cls, config, device: torch.device, rank_main) -> "RankGroup":
        """Spawns ranks 1..N-1, each running rank_main(config, rank, port, conn, parent pid,
        threads), and joins the process group with them as rank 0."""
        import torch.distributed as dist

        if dist.is_initialized():
            raise RankError("a tensor-parallel engine is already running in this process: close() it first")
        n = config.tensor_parallel_size
        threads = torch.get_num_threads()
        share = max(1, threads // n) if device.type == "cpu" else threads  # N processes share the cores
        ctx = rank_context()
        port = _free_port()
        procs, conns = [], []
        for rank in range(1, n):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_rank_entry, args=(rank_main, dict(os.environ), config, rank, port, theirs,
                                                         os.getpid(), share),
                               name=f"{RANK_NAME}{rank}", daemon=True)
            proc.start()
            theirs.close()
            procs.append(proc)
            conns.append(mine)
        group = cls(procs, conns, config.distributed_timeout_s, threads)
        torch.set_num_threads(share)
        try:
            group.wait_for("hello", None)  # imports take what they take on a busy machine; a dead rank fails
            init_group(config, 0, port, device)
        except BaseException as exc:
            error = group.failure(exc, in_pass=False)
            if not isinstance(exc, Exception):
                raise
            if error is exc and not isinstance(exc, RankError):
                error = RankError(f"tensor-parallel rank 0 (pid {os.getpid()}) could not join ranks {group.pids}: "
                                  f"{one_line(exc)}; all ranks are stopped")
            raise error from None
        return group

    def new_key(self) -> int:
        return next(self._keys)

    def wait_for(self, what: str, timeout_s: float | None) -> dict[int, object]:
        """Waits until every rank reported `what` (a rank that fails to start fails at once);
        rank -> what its report carried."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        waiting, reports = set(range(len(self.procs))), {}
        while waiting:
            for i in list(waiting):
                if self.conns[i].poll(POLL_S / max(1, len(waiting))):
                    kind, message = self.conns[i].recv()
                    if kind == "error":
                        raise RankError(self._describe(i, f"failed: {message}"))
                    if kind == what:
                        waiting.discard(i)
                        reports[i + 1] = message
            self.check()
            if deadline is not None and time.monotonic() > deadline:
                i = min(waiting)
                raise RankError(self._describe(i, f"did not report {what} within distributed_timeout_s="
                                                  f"{self.timeout_s:g}"))
        return reports

    def check(self) -> None:
        """Raises RankError if a rank has exited."""
        for i, proc in enumerate(self.procs):
            if proc.exitcode is not None:
                message = self._pending_error(i)
                code = proc.exitcode
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                raise RankError(self._describe(i, how + (f" ({message})" if message else "")))

    def send(self, *command) -> None:
        """Sends one command to every rank (after checking they are alive)."""
        self.check()
        try:
            for conn in self.conns:
                conn.send(command)
        except OSError as exc:  # a pipe closed: its rank died since check()
            raise self.failure(exc) from None

    def failure(self, exc: BaseException, in_pass: bool = True) -> BaseException:
        """Stops every rank; returns the error that names the rank that failed, else (every rank
        alive) a RankError around `exc` for a pass, `exc` itself otherwise (rank 0's own load). A
        RankError already names its rank and cause (a rank's own report of its error): it stays,
        as does rank 0's ModelLoadError, a refusal of the checkpoint that every rank makes (the
        ranks, forked already importing the engine, often make it first)."""
        if isinstance(exc, RankError) or (not in_pass and isinstance(exc, ModelLoadError)):
            self.close(graceful=False)
            return exc
        try:
            for proc in self.procs:  # a rank that failed is usually exiting as rank 0 learns of it
                proc.join(FAIL_WAIT_S)
            self.check()
            error = exc if isinstance(exc, RankError) or not in_pass else RankError(
                f"tensor-parallel pass failed in rank 0 (pid {os.getpid()}) with every rank alive (a hung rank "
                f"times out after distributed_timeout_s={self.timeout_s:g}): {one_line(exc)}; all ranks are stopped")
            for i in range(len(self.procs)):
                message = self._pending_error(i)
                if message:
                    error = RankError(self._describe(i, f"failed: {message}"))
                    break
        except RankError as found:
            error = found
        self.close(graceful=False)
        return error

    def close(self, graceful: bool = True) -> None:
        """Stops the ranks (asking them first and waiting up to STOP_S when graceful, else killing
        them at once) and leaves the process group."""
        if not graceful:
            if self._finalizer.detach() is not None:
                _stop(self.procs, self.conns, self._threads, 0.0)
            return
        for proc, conn in zip(self.procs, self.conns):
            try:
                if proc.exitcode is None:
                    conn.send(("close",))
            except OSError:
                pass
        self._finalizer()

    def _pending_error(self, i: int) -> str | None:
        try:
            while self.conns[i].poll():
                kind, message = self.conns[i].recv()
                if kind == "error":
                    return message
        except (EOFError, OSError):
            pass
        return None

    def _describe(self, i: int, what: str) -> str:
        return f"tensor-parallel rank {i + 1} (pid {self.procs[i].pid}) {what}; all ranks are stopped"


def _stop(procs, conns, threads: int, wait_s: float) -> None:
    """Joins (killing after wait_s) every rank, and leaves the process group: close(), garbage or exit."""
    for conn in conns:
        conn.close()  # a rank waiting for a command sees EOF and exits
    deadline = time.monotonic() + wait_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.exitcode is None:
            proc.kill()
            proc.join(STOP_S)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    torch.set_num_threads(threads)


# -- in a rank's own process -----------------------------------------------------------------


def join_as_rank(config, rank: int, port: int, parent: int, threads: int, device: torch.device) -> None:
    """The start of a rank's process: it exits when `parent` (rank 0) does, and joins the group."""
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    torch.set_num_threads(threads)
    init_group(config, rank, port, device)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the r-th visible GPU on CUDA, else the (shared) CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def _exit_with_parent(parent: int) -> None:
    while _alive(parent):
        time.sleep(POLL_S)
    os._exit(1)


def _alive(pid: int) -> bool:
    """Whether process `pid` (rank 0: not this rank's parent, the fork server is) still runs; a
    zombie, killed and not yet reaped, does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True  # no /proc here: the signal found it
