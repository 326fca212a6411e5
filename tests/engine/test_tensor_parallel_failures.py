"""A tensor-parallel engine whose rank dies or hangs fails within its timeout, naming the rank,
and leaves no process behind; ranks die with the process that started them."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.api.errors import RankError

TIMEOUT_S = 2.0
ROOT = Path(__file__).resolve().parents[2]


def start(path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), max_batch_tokens=1024, tensor_parallel_size=2,
                                  distributed_timeout_s=TIMEOUT_S))


def gone(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if _zombie(pid):  # exited; its new parent (an orphan's) has not reaped it yet
            return True
        try:  # a child of this process is gone once reaped
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        time.sleep(0.05)
    return False


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def test_a_rank_killed_mid_generation_fails_the_engine_naming_it(tiny_model_dir):
    llm = start(tiny_model_dir("llama"))
    (pid,) = llm.runner.ranks.pids
    llm.generate(["warm"], SamplingParams(max_tokens=2))
    killer = threading.Timer(0.3, os.kill, (pid, signal.SIGKILL))
    began = time.monotonic()
    killer.start()
    with pytest.raises(RankError) as err:
        llm.generate(["Hello there"] * 8, SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
    assert time.monotonic() - began < TIMEOUT_S + 2
    assert str(err.value) == f"tensor-parallel rank 1 (pid {pid}) was killed by signal 9; all ranks are stopped"
    assert gone(pid)
    assert not llm.has_unfinished()  # the failed call's requests were ended with it
    with pytest.raises(RankError, match="rank 1"):  # the engine stays failed
        llm.generate(["again"], SamplingParams(max_tokens=2))


@pytest.mark.slow  # ~13 s; its fast sibling: the rank killed mid-generation above fails the engine the same way
def test_a_hung_rank_fails_the_engine_within_the_timeout(tiny_model_dir):
    llm = start(tiny_model_dir("llama"))
    (pid,) = llm.runner.ranks.pids
    os.kill(pid, signal.SIGSTOP)
    began = time.monotonic()
    with pytest.raises(RankError, match=r"with every rank alive \(a hung rank times out after "
                                        r"distributed_timeout_s=2\): .*; all ranks are stopped$"):
        llm.generate(["Hello there"], SamplingParams(max_tokens=4))
    assert TIMEOUT_S - 0.5 < time.monotonic() - began < TIMEOUT_S + 8
    assert gone(pid)


PARENT = textwrap.dedent("""
    import sys, time
    from engine import EngineConfig, LLMEngine
    if __name__ == "__main__":
        llm = LLMEngine(EngineConfig(model=sys.argv[1], max_batch_tokens=256, tensor_parallel_size=2))
        print(*llm.runner.ranks.pids, flush=True)
        time.sleep(120)
""")


def test_ranks_die_with_a_killed_parent(tiny_model_dir, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    parent = subprocess.Popen([sys.executable, str(script), str(tiny_model_dir("llama"))], stdout=subprocess.PIPE,
                              text=True, env=env, cwd=ROOT)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 1 and not gone(pids[0], within_s=0.2)
        parent.kill()
        parent.wait(10)
        assert gone(pids[0], within_s=3.0)
    finally:
        parent.kill()


def test_a_ranks_own_error_is_the_error_raised():
    """A rank that reports its error (its exception, one line) and exits: the engine's RankError
    is that report, not the bare exit code the rank shows once it is gone."""
    from engine.distributed.ranks import RankGroup

    ranks = RankGroup.__new__(RankGroup)
    ranks.procs, stopped = [], []
    ranks.close = lambda graceful=True: stopped.append(graceful)
    ranks.check = lambda: (_ for _ in ()).throw(RankError("tensor-parallel rank 1 (pid 7) exited with code 1"))
    report = RankError("tensor-parallel rank 1 (pid 7) failed: AttributeError: 'NoHead' object has no attribute "
                       "'weight'; all ranks are stopped")
    assert ranks.failure(report) is report and stopped == [False]


def _report_variable(conn, name: str) -> None:
    conn.send(os.environ.get(name))


def test_a_rank_takes_rank_0s_environment_as_it_is_when_it_starts(monkeypatch):
    """Ranks fork from a fork server that keeps the environment it started with: a variable set
    afterwards (a fault hook, CUDA_VISIBLE_DEVICES) still reaches the next rank."""
    from engine.distributed.ranks import _rank_entry, rank_context

    ctx = rank_context()

    def value_in_a_rank() -> str | None:
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=_rank_entry, args=(_report_variable, dict(os.environ), theirs,
                                                     "BATCHINFER_TEST_RANK_ENV"), daemon=True)
        proc.start()
        theirs.close()
        try:
            return mine.recv()
        finally:
            proc.join(10)

    monkeypatch.delenv("BATCHINFER_TEST_RANK_ENV", raising=False)
    assert value_in_a_rank() is None  # the fork server is running from here on
    monkeypatch.setenv("BATCHINFER_TEST_RANK_ENV", "set later")
    assert value_in_a_rank() == "set later"


def test_rank_0_killed_and_not_yet_reaped_counts_as_gone():
    """A rank watches rank 0's pid (its parent is the fork server): a zombie is not alive."""
    from engine.distributed.ranks import _alive

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert _alive(child.pid)
        child.kill()
        deadline = time.monotonic() + 5
        while not _zombie(child.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _zombie(child.pid) and not _alive(child.pid)  # killed, not yet reaped by us
    finally:
        child.kill()
        child.wait()
    assert not _alive(child.pid)
