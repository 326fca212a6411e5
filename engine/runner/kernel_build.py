"""Building the CPU attention kernel (C++, through torch's extension builder and ninja): once per
machine and environment, in the background, never waiting forever, never loading a binary built
for another one.

- An engine that finds no binary starts the build in a detached process and runs the torch path
  (the same tokens, slower decode) until the build is there: the next engine process loads it.
  A first run never waits on the compiler (about a minute of one core, more on a busy machine).

- The build goes into a directory named by a key of everything the binary depends on: the
  source, torch's version, the interpreter's ABI, the compiler and its flags, and the CPU's
  instruction-set features (-march=native). Two virtualenvs, two torch builds or two machines
  of different CPUs sharing a home directory each get their own binary, and none rebuilds
  another's.
- One build at a time per directory, under an OS file lock (flock): the kernel releases it when
  its holder dies, so a build killed by Ctrl-C, Ray or the OOM killer leaves nothing to wait on.
  torch's own lock file in the directory, which a killed build leaves behind forever, is removed
  under that lock before building.
- The compiler runs in a child process, killed with everything it started after
  BUILD_TIMEOUT_S (also the most a process that waits for a build, as the tests do, waits).
- A failed build is recorded in its directory (later processes do not retry it) and said once
  per process on stderr, in one line with how to retry or silence it.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import filelock
import torch

log = logging.getLogger(__name__)

BUILD_TIMEOUT_S = float(os.environ.get("BATCHINFER_CPU_KERNEL_TIMEOUT_S", "600"))
"""Longest a build may take, and a process may wait for another's (BATCHINFER_CPU_KERNEL_TIMEOUT_S)."""
FLAGS = ("-O3", "-ffast-math", "-march=native")
SILENCE = "BATCHINFER_CPU_KERNEL=0"
"""The setting that keeps the engine on the torch path without trying (or reporting) a build."""

_CHILD = """
import sys
from torch.utils.cpp_extension import load_inline
name, build_dir, source, functions, *flags = sys.argv[1:]
load_inline(name, cpp_sources=open(source).read(), functions=functions.split(","), extra_cflags=flags,
            build_directory=build_dir, verbose=False)
"""


class KernelBuild:
    """One C++ source built into an importable module for this environment."""

    def __init__(self, source: Path, functions: tuple[str, ...], flags: tuple[str, ...] = FLAGS,
                 root: Path | None = None, timeout_s: float | None = None):
        self.source = source
        self.functions = functions
        self.flags = flags
        self.timeout_s = BUILD_TIMEOUT_S if timeout_s is None else timeout_s
        self.name = f"batchinfer_{source.stem}_{self.key()[:16]}"
        self.dir = (root or kernel_cache()) / self.name
        """Where this environment's binary is built; a sibling key is another environment's."""

    def key(self) -> str:
        """A digest of everything the binary depends on."""
        parts = [self.source.read_text(), torch.__version__, str(torch.version.git_version),
                 sys.implementation.cache_tag, sysconfig.get_config_var("SOABI") or "", compiler(),
                 " ".join(self.flags), cpu_features()]
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()

    @property
    def library(self) -> Path:
        return self.dir / f"{self.name}.so"

    def load(self, wait: bool = False):
        """The built module (None: not built here yet, or it cannot be; the reason said once). With
        no binary yet, the build starts in the background, or with `wait` runs here (bounded)."""
        if (self.dir / ".complete").exists():
            return self._import()
        if (self.dir / "failed").exists():
            return report((self.dir / "failed").read_text().strip(), self.dir)
        if not wait:
            self.start_in_background()
            return report("it is being built in the background, for the next engine process to load", None)
        error = self.build()
        return self._import() if error is None else report(error, self.dir if (self.dir / "failed").exists() else None)

    def start_in_background(self) -> None:
        """Runs `build` in a detached process (python -m engine.runner.kernel_build), which outlives
        this one; it does nothing when another process is building already."""
        self.dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                           os.environ.get("PYTHONPATH", "")]))
        with open(self.dir / "background.log", "a") as out:
            subprocess.Popen([sys.executable, "-m", "engine.runner.kernel_build", str(self.source),
                              ",".join(self.functions), str(self.dir.parent), str(self.timeout_s), *self.flags],
                             env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)

    def build(self, lock_timeout_s: float | None = None) -> str | None:
        """Builds the binary unless it is there, one process at a time; the error in one line (also
        recorded in the directory when the build itself failed), or None once built."""
        self.dir.mkdir(parents=True, exist_ok=True)
        wait_s = self.timeout_s if lock_timeout_s is None else lock_timeout_s
        try:
            with filelock.FileLock(str(self.dir / ".build.lock"), timeout=wait_s):
                if (self.dir / ".complete").exists():
                    return None
                error = self._build()
                if error is not None:
                    (self.dir / "failed").write_text(error + "\n")
                return error
        except filelock.Timeout:
            return f"another process is still building it after {wait_s:.0f} s"

    def _build(self) -> str | None:
        """Compiles in a child process (killed with its compilers after the bound); the error in
        one line, or None once built."""
        (self.dir / "lock").unlink(missing_ok=True)  # torch's baton: stale, since we hold the build lock
        env = dict(os.environ)
        # ninja installed beside this interpreter (a virtualenv's bin/) is found without activating it
        env["PATH"] = os.pathsep.join([sysconfig.get_path("scripts"), env.get("PATH", "")])
        command = [sys.executable, "-c", _CHILD, self.name, str(self.dir), str(self.source), ",".join(self.functions),
                   *self.flags]
        child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 start_new_session=True)
        try:
            output, _ = child.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.communicate()
            return f"the build took over {self.timeout_s:.0f} s (BATCHINFER_CPU_KERNEL_TIMEOUT_S)"
        (self.dir / "build.log").write_text(output)
        if child.returncode != 0 or not self.library.exists():
            return last_error(output) or f"the build exited with code {child.returncode}"
        (self.dir / ".complete").touch()
        return None

    def _import(self):
        spec = importlib.util.spec_from_file_location(self.name, self.library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


def kernel_cache() -> Path:
    """Where kernels are built: $BATCHINFER_KERNEL_CACHE, else batchinfer/ under torch's own
    extension directory ($TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions). Apart from the
    model cache (BATCHINFER_CACHE), so a job or test that moves that does not rebuild."""
    if os.environ.get("BATCHINFER_KERNEL_CACHE"):
        return Path(os.environ["BATCHINFER_KERNEL_CACHE"])
    torch_dir = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(torch_dir) / "batchinfer"


def compiler() -> str:
    """The C++ compiler torch's builder would use ($CXX, else c++) and its version line."""
    cxx = os.environ.get("CXX", "c++")
    path = shutil.which(cxx)
    if path is None:
        return f"{cxx}: not found"
    try:
        first = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        first = ""
    return f"{path} {first.splitlines()[0] if first else ''}"


def cpu_features() -> str:
    """The CPU's architecture and instruction-set features (what -march=native compiles for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return f"{platform.machine()} {' '.join(sorted(line.split(':', 1)[1].split()))}"
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def last_error(output: str) -> str:
    """The line of a build's output that says what failed."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in reversed(lines):
        if "error" in line.lower():
            return line[:300]
    return lines[-1][:300] if lines else ""


_REPORTED: list[str] = []


def report(reason: str, where: Path | None) -> None:
    """Says, once per process, that the kernel is unavailable and why (one line on stderr)."""
    if not _REPORTED:
        retry = f"delete {where} to retry; " if where is not None else ""
        print(f"batchinfer: the CPU attention kernel is unavailable ({reason}); decode uses the torch path, "
              f"slower. {retry}{SILENCE} silences this", file=sys.stderr)
        _REPORTED.append(reason)
    log.debug("CPU attention kernel unavailable: %s", reason)
    return None


if __name__ == "__main__":  # the background build: SOURCE FUNCTIONS ROOT TIMEOUT_S FLAGS...
    _source, _functions, _root, _timeout, *_flags = sys.argv[1:]
    _build = KernelBuild(Path(_source), tuple(_functions.split(",")), tuple(_flags), Path(_root), float(_timeout))
    _error = _build.build(lock_timeout_s=0)  # another process building already: nothing to do
    print(_error or f"built {_build.library}", flush=True)
