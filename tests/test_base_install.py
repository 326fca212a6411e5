"""Every module under engine/, pipeline/ and jobs/ imports with the base install alone (the demo's:
`pip install batchinfer`, no extra), or fails in one line naming the extra that brings what it needs.
The test extra's own distributions (those no base requirement pulls in) are hidden from a child
interpreter, which then imports every module."""
from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]

NEEDS_AN_EXTRA = {"engine.runner.kernels.triton_attention": "batchinfer[kernels]"}
"""The modules that need a distribution of an extra: the extra each one's error names."""

IMPORT_ALL = """
import importlib, json, pkgutil, site, sys
site.addsitedir(sys.argv[1])  # the base install's site-packages (this interpreter runs with -S)
sys.path.insert(0, sys.argv[2])  # the checkout
failed = {}
for package in sys.argv[3].split(","):
    names = [package] + [m.name for m in pkgutil.walk_packages(importlib.import_module(package).__path__,
                                                               package + ".")]
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(failed))
"""
TOOLS = {"pip", "setuptools", "wheel"}
"""Installed beside any install."""


def top_level(dist: metadata.Distribution) -> set[str]:
    """The entries of site-packages that a distribution's files live under."""
    return {Path(str(f)).parts[0] for f in dist.files or () if not str(f).startswith("..")}


def base_site(tmp_path: Path, hide: set[str] | None = None) -> Path:
    """A site-packages of links to this interpreter's, less every entry of a distribution that the base
    install does not pull in (or of those named in `hide`)."""
    base = base_closure() | TOOLS
    dists = {canonicalize_name(d.metadata["Name"]): d for d in metadata.distributions() if d.metadata["Name"]}
    hidden = set(hide) if hide is not None else set(dists) - base
    kept = set().union(*(top_level(d) for name, d in dists.items() if name not in hidden))
    dropped = set().union(*(top_level(dists[name]) for name in hidden if name in dists)) - kept
    packages = Path(sysconfig.get_paths()["purelib"])
    site = tmp_path / "site-packages"
    site.mkdir()
    for entry in packages.iterdir():
        if entry.name not in dropped and not entry.name.startswith("__editable__"):
            (site / entry.name).symlink_to(entry)
    return site


def import_all(site: Path, packages: str = "engine,pipeline,jobs") -> dict[str, str]:
    out = subprocess.run([sys.executable, "-S", "-c", IMPORT_ALL, str(site), str(ROOT), packages], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def base_closure() -> set[str]:
    """The distributions batchinfer's base install pulls in (installed ones, markers evaluated, no extras)."""
    seen, todo = set(), [canonicalize_name("batchinfer")]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(requirement.name))
    return seen


def test_every_module_imports_with_the_base_install_or_names_its_extra(tmp_path):
    site = base_site(tmp_path)
    names = {entry.name for entry in site.iterdir()}
    for test_only in ("moto", "sentence_transformers", "peft", "openai", "matplotlib", "boto3", "mistral_common",
                      "accelerate"):
        assert test_only not in names, f"{test_only} is not a test-extra distribution here"
    for base in ("torch", "transformers", "ray", "PIL", "num2words", "xgrammar"):
        assert base in names, f"{base} comes with the base install"
    failed = import_all(site)
    unexpected = {module: error for module, error in failed.items() if module not in NEEDS_AN_EXTRA}
    assert not unexpected, unexpected
    for module, extra in NEEDS_AN_EXTRA.items():
        # triton comes with the base install where xgrammar pulls it in (Linux x86_64)
        assert module not in failed or (extra in failed[module] and "\n" not in failed[module]), failed[module]


def test_a_module_that_needs_an_extra_names_it_when_its_distribution_is_missing(tmp_path):
    failed = import_all(base_site(tmp_path, hide={"triton"}), packages="engine.runner.kernels")
    assert failed == {"engine.runner.kernels.triton_attention": (
        "ImportError: engine.runner.kernels.triton_attention needs triton: a CUDA build of torch brings it, "
        "or pip install 'batchinfer[kernels]'")}
