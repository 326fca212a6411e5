"""The lock (constraints.txt) holds what scripts/setup.sh installs: .venv has every distribution it
names at its pinned version, every requirement of setup.cfg's base install and of the extras it
covers is in it, it is made for the Python the setup uses, and `scripts/lock.py check` tells a
hand-installed drift (which setup then puts back)."""
from __future__ import annotations

import configparser
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("lock", ROOT / "scripts" / "lock.py")
lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lock)

in_venv = pytest.mark.skipif(Path(sys.prefix).resolve() != (ROOT / ".venv").resolve()
                             or os.environ.get("BATCHINFER_LOCK") == "0",
                             reason="the lock holds .venv, as scripts/setup.sh makes it")


def requirements(extras: tuple[str, ...]) -> list[Requirement]:
    """setup.cfg's install_requires and the named extras' requirements that apply here."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    groups = [("", cfg["options"]["install_requires"])]
    groups += [(extra, cfg["options.extras_require"][extra]) for extra in extras]
    out = []
    for extra, text in groups:
        for line in text.splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                requirement = Requirement(line)
                if requirement.marker is None or requirement.marker.evaluate({"extra": extra}):
                    out.append(requirement)
    return out


def test_every_requirement_of_the_base_install_and_the_locked_extras_is_pinned():
    pins, _ = lock.read_lock()
    missing = [str(r) for r in requirements(lock.EXTRAS) if lock.normalized(r.name) not in pins
               and lock.normalized(r.name) not in lock.UNLOCKED]
    assert not missing, f"in setup.cfg but not in constraints.txt (run scripts/refresh_lock.sh): {missing}"


def test_every_pin_satisfies_setup_cfgs_ranges():
    pins, _ = lock.read_lock()
    outside = [f"{r.name}=={pins[lock.normalized(r.name)]} (setup.cfg: {r})" for r in requirements(lock.EXTRAS)
               if lock.normalized(r.name) in pins and not r.specifier.contains(pins[lock.normalized(r.name)],
                                                                             prereleases=True)]
    assert not outside, outside


def test_the_lock_leaves_torch_to_torch_spec_and_pins_the_installers():
    pins, _ = lock.read_lock()
    assert "torch" not in pins and "batchinfer" not in pins
    assert {"pip", "setuptools", "wheel"} <= set(pins)


@in_venv
def test_the_lock_is_made_for_the_setups_python():
    assert lock.read_lock()[1] == lock.target()


@in_venv
def test_venv_holds_every_pinned_distribution_at_its_version():
    differences = lock.drift(complete=True)
    assert not differences, ("\n".join(f"{name}: {have or 'not installed'}, the lock pins {pinned}"
                                       for name, pinned, have in differences))


def run_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "lock.py"), "check", *args],
                          capture_output=True, text=True, timeout=60)


def test_check_names_each_drifted_and_missing_distribution(tmp_path):
    import pytest as installed_one

    path = tmp_path / "constraints.txt"
    # PyTest: pytest's name as another spelling writes it (names compare normalized)
    path.write_text(f"# target: {lock.target()}\nPyTest==0.0.1\nno-such-distribution==1.0\n")
    out = run_check("--lock", str(path))
    assert out.returncode == 1 and out.stdout.strip() == f"pytest: {installed_one.__version__}, the lock pins 0.0.1"
    fixes = run_check("--lock", str(path), "--fixes", "--complete")
    assert fixes.returncode == 1 and fixes.stdout.split() == ["no-such-distribution==1.0", "pytest==0.0.1"]
    path.write_text(f"pytest=={installed_one.__version__}\n")
    assert run_check("--lock", str(path)).returncode == 0
