"""The pipeline's packages and the one direction of their imports, read from the code (ast):

    spec <- {io, tasks} <- run <- processor      errors below them all

io and tasks never import each other; only run/ and processor.py import Ray; spec imports the
engine's torch-free face alone (engine, engine.api); io imports no engine. Across engine/, pipeline/
and jobs/ there is no import cycle (imports under TYPE_CHECKING aside) and no module over 400 lines.
"""
from __future__ import annotations

import pytest

from import_graph import MAX_LINES, ROOT, declared_all, find_cycle, graph, modules

MAY_IMPORT = {
    "errors": set(),
    "spec": {"errors"},
    "io": {"errors", "spec"},
    "tasks": {"errors", "spec"},
    "run": {"errors", "spec", "io", "tasks"},
    "processor": {"errors", "spec", "io", "tasks", "run"},
}
"""The pipeline packages each package may import, besides itself."""

RUN_MAY_IMPORT = {
    "driver": {"checks", "shards", "reporting"},
    "checks": {"shards", "reporting"},
    "shards": {"reporting"},
    "reporting": set(),
}
"""Inside run/: the driver over its three packages, each answering one question (pipeline/run/__init__.py)."""

FACES = {"pipeline", "pipeline.index"}
"""Modules that only hand on names from their new homes (documented imports)."""


def layer(module: str) -> str | None:
    """The pipeline package a module belongs to (None outside pipeline/, or for a face)."""
    parts = module.split(".")
    if parts[0] != "pipeline" or module in FACES:
        return None
    return parts[1]


KNOWN = modules()
GRAPH = graph(KNOWN)


def test_the_pipeline_has_its_packages_each_with_a_face():
    for package in ("spec", "io", "tasks", "run"):
        face = ROOT / "pipeline" / package / "__init__.py"
        assert face.exists(), face
        assert declared_all(face), f"{face} declares no __all__"
    assert set(MAY_IMPORT) == {m.split(".")[1] for m in KNOWN if layer(m)}


@pytest.mark.parametrize("module", sorted(m for m in KNOWN if layer(m)))
def test_imports_run_one_way(module):
    own = layer(module)
    for target in GRAPH[module]:
        other = layer(target) if target.startswith("pipeline.") else None
        if target.startswith("pipeline.") and target not in FACES:
            assert other == own or other in MAY_IMPORT[own], f"{module} imports {target}: {own} may not import {other}"
        root = target.split(".")[0]
        if root == "ray":
            assert own in ("run", "processor"), f"{module} imports {target}: only run/ and processor import Ray"
        if own == "spec":
            assert root not in ("torch", "transformers") and (root != "engine" or target in ("engine", "engine.api")), \
                f"{module} imports {target}: the spec reads the engine's torch-free face alone"
        if own == "io":
            assert root not in ("engine", "torch", "transformers"), f"{module} imports {target}: io has no engine"
    assert "jobs" not in {t.split(".")[0] for t in GRAPH[module]}


def run_part(module: str) -> str | None:
    """run/'s package of a module (driver for pipeline.run.driver), None for run/'s face or outside run/."""
    parts = module.split(".")
    return parts[2] if parts[:2] == ["pipeline", "run"] and len(parts) > 2 else None


def test_run_has_its_three_packages_and_the_driver():
    assert {run_part(m) for m in KNOWN if run_part(m)} == set(RUN_MAY_IMPORT)


@pytest.mark.parametrize("module", sorted(m for m in KNOWN if run_part(m)))
def test_inside_run_imports_run_one_way(module):
    own = run_part(module)
    for target in GRAPH[module]:
        other = run_part(target)
        if other is not None and other != own:
            assert other in RUN_MAY_IMPORT[own], f"{module} imports {target}: run/{own} may not import run/{other}"


def test_jobs_import_the_pipeline_through_its_faces():
    faces = {"pipeline", "pipeline.errors", "pipeline.spec", "pipeline.io", "pipeline.tasks", "pipeline.run",
             "pipeline.processor", "pipeline.index"}
    for module in (m for m in KNOWN if m.startswith("jobs")):
        inner = sorted(t for t in GRAPH[module] if t.startswith("pipeline") and t not in faces)
        assert not inner, f"{module} imports {inner}: import the package's face instead"


def test_no_import_cycle_among_the_product_modules():
    cycle = find_cycle({m: {t for t in GRAPH[m] if t in KNOWN and t != m} for m in KNOWN})
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_product_module_is_over_400_lines():
    long = {m: n for m, p in KNOWN.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long
