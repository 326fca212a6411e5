"""The CPU attention kernel's build: a missing compiler, a build killed mid-way, a build that
hangs and two environments sharing a home never hang an engine or load the wrong binary, and
the torch path the engine falls back to gives the kernel's tokens."""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.runner import attention, kernel_build
from engine.runner.kernel_build import KernelBuild

SOURCE = Path(attention.__file__).parent / "kernels" / "paged_attention_cpu.cpp"
HOLD = ("import filelock, sys, time; lock = filelock.FileLock(sys.argv[1]); lock.acquire(); "
        "print('held', flush=True); time.sleep(600)")


def build(root: Path, **kwargs) -> KernelBuild:
    return KernelBuild(SOURCE, ("paged_attention",), root=root, **kwargs)


@pytest.fixture(autouse=True)
def fresh_report(monkeypatch):
    monkeypatch.setattr(kernel_build, "_REPORTED", [])


def hold_lock(path: Path) -> subprocess.Popen:
    """A process holding the build lock `path` (as a build in progress does)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_without_a_compiler_the_build_fails_once_in_one_line_and_is_not_retried(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    first = build(tmp_path)
    assert first.load(wait=True) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "CPU attention kernel is unavailable" in err[0] and "BATCHINFER_CPU_KERNEL=0 silences this" in err[0]
    assert f"delete {first.dir} to retry" in err[0] and (first.dir / "failed").exists()
    started = time.monotonic()
    assert build(tmp_path).load(wait=True) is None  # the recorded failure: no second build
    assert time.monotonic() - started < 1.0
    assert capsys.readouterr().err == ""  # said once per process


def test_an_engine_never_waits_for_the_build_it_starts_in_the_background(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))  # inherited: the detached build fails
    b = build(tmp_path)
    started = time.monotonic()
    assert b.load() is None
    assert time.monotonic() - started < 2
    assert "being built in the background" in capsys.readouterr().err
    deadline = time.monotonic() + 120
    while not (b.dir / "failed").exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert (b.dir / "failed").exists(), (b.dir / "background.log").read_text()
    monkeypatch.setattr(kernel_build, "_REPORTED", [])  # as in the next process: told why, once
    assert b.load() is None and f"delete {b.dir} to retry" in capsys.readouterr().err


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_one(tmp_path, monkeypatch):
    b = build(tmp_path, timeout_s=60)
    b.dir.mkdir(parents=True)
    holder = hold_lock(b.dir / ".build.lock")
    holder.kill()  # killed mid-build: its lock file stays, its flock goes with it
    holder.wait()
    (b.dir / "lock").write_text("")  # torch's own lock file, which a killed build leaves forever
    # the build fails at once: what counts is that it ran
    monkeypatch.setattr(kernel_build, "_CHILD", "raise SystemExit('error: built nothing')")
    started = time.monotonic()
    assert b.load(wait=True) is None
    assert time.monotonic() - started < 30
    assert (b.dir / "failed").read_text().strip() == "error: built nothing" and not (b.dir / "lock").exists()


def test_a_build_that_another_process_holds_past_the_bound_falls_back(tmp_path, capsys):
    b = build(tmp_path, timeout_s=1)
    b.dir.mkdir(parents=True)
    holder = hold_lock(b.dir / ".build.lock")
    try:
        started = time.monotonic()
        assert b.load(wait=True) is None
        assert time.monotonic() - started < 10
        assert "another process is still building it after 1 s" in capsys.readouterr().err
        assert not (b.dir / "failed").exists()  # that build may still succeed: nothing recorded
    finally:
        holder.kill()
        holder.wait()


def test_a_build_that_hangs_is_killed_at_the_bound(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(kernel_build, "_CHILD", "import time; time.sleep(600)")
    b = build(tmp_path, timeout_s=2)
    started = time.monotonic()
    assert b.load(wait=True) is None
    assert time.monotonic() - started < 15
    assert "the build took over 2 s" in capsys.readouterr().err
    assert "took over 2 s" in (b.dir / "failed").read_text()


def test_each_environment_and_cpu_builds_its_own_binary(tmp_path, monkeypatch):
    """Two virtualenvs (two torch builds), other compiler flags or a machine of other CPU
    features sharing this home: each gets a directory of its own, so none rebuilds or loads
    another's binary."""
    dirs = {build(tmp_path).dir}
    assert build(tmp_path).dir in dirs  # the same environment finds its own build again
    dirs.add(build(tmp_path, flags=("-O2",)).dir)
    monkeypatch.setattr(kernel_build, "cpu_features", lambda: "x86_64 fpu sse sse2")
    dirs.add(build(tmp_path).dir)
    monkeypatch.setattr(torch, "__version__", "0.0.0+other")
    dirs.add(build(tmp_path).dir)
    monkeypatch.setenv("CXX", "clang++-99")
    dirs.add(build(tmp_path).dir)
    assert len(dirs) == 5


def test_the_features_name_the_cpus_instruction_sets():
    features = kernel_build.cpu_features()
    if Path("/proc/cpuinfo").exists() and sys.platform.startswith("linux"):
        assert len(features.split()) > 3  # the architecture and its flags (sse2, avx2, ... or neon, asimd)


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler: the kernel cannot be built here")
def test_the_torch_path_gives_the_kernels_tokens(monkeypatch):
    kernel = attention.load_cpu_kernel(wait=True)
    assert kernel is not None, "the kernel does not build on a machine with a compiler (ninja missing?)"
    llm = LLMEngine(EngineConfig(model="builtin:tiny", dtype="float32", max_num_seqs=8))
    prompts = [f"row {i}: " + "abc" * i for i in range(8)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    monkeypatch.setattr(attention, "_KERNEL", [kernel])
    with_kernel = [c.token_ids for c in llm.generate(prompts, params)]
    monkeypatch.setattr(attention, "_KERNEL", [None])
    fallback = [c.token_ids for c in llm.generate(prompts, params)]
    assert fallback == with_kernel
