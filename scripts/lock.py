"""constraints.txt: the fully pinned lock that scripts/setup.sh installs with.

  python scripts/lock.py resolve [--out constraints.txt]   re-resolve to the newest the registry serves
  python scripts/lock.py check [--complete] [--fixes]      compare this interpreter's packages with it
  python scripts/lock.py covers                            exit 0 if the lock was made for this Python

`resolve` asks pip (never installing) for the newest versions within setup.cfg's ranges of the base
install and its `test` and `vision` extras, beside `TORCH_SPEC` (torch==2.13.0, the CPU build on this
machine's disk) and pip, setuptools and wheel, and writes every distribution but torch and batchinfer
with its version: torch stays TORCH_SPEC's, so that a CUDA host picks its own build. The lock is made
for one Python and platform, named in its header; scripts/refresh_lock.sh runs this, then the setup
and the default part of the tests.

`check` lists each installed distribution the lock pins at another version (with --complete, each one
it names that is not installed too), one a line; --fixes prints them as `name==version` requirements
for pip. It imports nothing but the standard library: setup runs it on every call.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from datetime import date
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "constraints.txt"
EXTRAS = ("test", "vision")
"""The extras the lock covers (beside the base install)."""
UNLOCKED = ("torch", "batchinfer")
"""Never pinned: torch is TORCH_SPEC's (a CUDA host picks its build), batchinfer is this checkout."""
TOOLS = ("pip", "setuptools", "wheel")


def normalized(name: str) -> str:
    """A distribution's name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def target() -> str:
    """The Python and platform a lock is made for: 'cpython-3.11-linux-x86_64'."""
    return (f"{sys.implementation.name}-{sys.version_info.major}.{sys.version_info.minor}-"
            f"{platform.system().lower()}-{platform.machine().lower()}")


def read_lock(path: Path = LOCK) -> tuple[dict[str, str], str | None]:
    """The lock's pins ({normalized name: version}) and the target its header names."""
    pins, made_for = {}, None
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.startswith("# target:"):
            made_for = line.split(":", 1)[1].strip()
        if not line or line.startswith("#"):
            continue
        name, _, version = line.partition("==")
        pins[normalized(name)] = version.split(";")[0].strip()
    return pins, made_for


def installed() -> dict[str, str]:
    """This interpreter's distributions, {normalized name: version}."""
    found = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(normalized(name), dist.version)
    return found


def drift(complete: bool = False, path: Path = LOCK) -> list[tuple[str, str, str | None]]:
    """(name, pinned, installed or None) for each distribution that differs from the lock."""
    pins, _ = read_lock(path)
    have = installed()
    return [(name, pinned, have.get(name)) for name, pinned in sorted(pins.items())
            if (name in have and have[name] != pinned) or (complete and name not in have)]


def resolve(out: Path) -> None:
    torch_spec = os.environ.get("TORCH_SPEC", "torch==2.13.0")
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        # --ignore-installed: the newest versions, whatever this interpreter already has
        command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                   "--disable-pip-version-check", "--report", str(report), *TOOLS, torch_spec,
                   "-e", f"{ROOT}[{','.join(EXTRAS)}]"]
        print("[lock] resolving:", " ".join(command[3:]), flush=True)
        subprocess.run(command, check=True)
        resolved = json.loads(report.read_text())["install"]
    pins = sorted((item["metadata"]["name"], item["metadata"]["version"]) for item in resolved
                  if normalized(item["metadata"]["name"]) not in UNLOCKED)
    pins.sort(key=lambda pin: normalized(pin[0]))
    lines = ["# The lock: every distribution scripts/setup.sh installs, pinned (torch apart: TORCH_SPEC's).",
             "# Made by `python scripts/lock.py resolve` (scripts/refresh_lock.sh: resolve, set up, test) from",
             f"# setup.cfg's base install and its {' and '.join(EXTRAS)} extras, beside {torch_spec},",
             f"# on {date.today().isoformat()}. Never edit it by hand; a refresh is a commit of its own.",
             f"# target: {target()}", ""]
    lines += [f"{name}=={version}" for name, version in pins]
    out.write_text("\n".join(lines) + "\n")
    print(f"[lock] {out.name}: {len(pins)} distributions pinned for {target()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    resolving = sub.add_parser("resolve")
    resolving.add_argument("--out", type=Path, default=LOCK)
    checking = sub.add_parser("check")
    checking.add_argument("--lock", type=Path, default=LOCK)
    checking.add_argument("--complete", action="store_true", help="every pinned distribution must be installed")
    checking.add_argument("--fixes", action="store_true", help="print name==version requirements for pip")
    sub.add_parser("covers")
    args = parser.parse_args(argv)
    if args.command == "resolve":
        resolve(args.out)
        return 0
    if args.command == "covers":
        made_for = read_lock()[1]
        if made_for != target():
            print(f"the lock is made for {made_for}, not {target()}", file=sys.stderr)
            return 1
        return 0
    differences = drift(complete=args.complete, path=args.lock)
    for name, pinned, have in differences:
        print(f"{name}=={pinned}" if args.fixes else f"{name}: {have or 'not installed'}, the lock pins {pinned}")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
