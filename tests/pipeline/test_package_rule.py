"""The pipeline's packages and the one direction of their imports, read from the code (ast):

    spec <- {io, tasks} <- run <- processor      errors below them all

io and tasks never import each other; only run/ and processor.py import Ray; spec imports the
engine's torch-free dataclasses alone (config, sampling_params, structured_outputs); io imports no engine. Across engine/, pipeline/
and jobs/ there is no import cycle (imports under TYPE_CHECKING aside) and no module over 400 lines.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("engine", "pipeline", "jobs")
MAX_LINES = 400

MAY_IMPORT = {
    "errors": set(),
    "spec": {"errors"},
    "io": {"errors", "spec"},
    "tasks": {"errors", "spec"},
    "run": {"errors", "spec", "io", "tasks"},
    "processor": {"errors", "spec", "io", "tasks", "run"},
}
"""The pipeline packages each package may import, besides itself."""

FACES = {"pipeline", "pipeline.index"}
"""Modules that only hand on names from their new homes (documented imports)."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for top in PRODUCT for p in sorted((ROOT / top).rglob("*.py"))}


def face_names(package: str, known: dict[str, Path]) -> set[str]:
    """Names a package's __init__.py binds at its top level (a name there wins over a submodule)."""
    path = known.get(package)
    if path is None or path.name != "__init__.py":
        return set()
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
    return names


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """Every module `path` imports, at any depth (functions too), except under TYPE_CHECKING.
    `from package import name` counts as importing package.name when that is a module."""
    found: set[str] = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known and alias.name not in face_names(base, known) else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return found


def layer(module: str) -> str | None:
    """The pipeline package a module belongs to (None outside pipeline/, or for a face)."""
    parts = module.split(".")
    if parts[0] != "pipeline" or module in FACES:
        return None
    return parts[1]


KNOWN = modules()
GRAPH = {name: imports(path, KNOWN) for name, path in KNOWN.items()}


def test_the_pipeline_has_its_packages_each_with_a_face():
    for package in ("spec", "io", "tasks", "run"):
        face = ROOT / "pipeline" / package / "__init__.py"
        assert face.exists(), face
        tree = ast.parse(face.read_text())
        names = [n for n in tree.body if isinstance(n, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)]
        assert names, f"{face} declares no __all__"
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
            assert root not in ("torch", "transformers") and (
                root != "engine" or target in ("engine.config", "engine.sampling_params", "engine.structured_outputs")), \
                f"{module} imports {target}"
        if own == "io":
            assert root not in ("engine", "torch", "transformers"), f"{module} imports {target}: io has no engine"
    assert "jobs" not in {t.split(".")[0] for t in GRAPH[module]}


def test_jobs_import_the_pipeline_through_its_faces():
    faces = {"pipeline", "pipeline.errors", "pipeline.spec", "pipeline.io", "pipeline.tasks", "pipeline.run",
             "pipeline.processor", "pipeline.index"}
    for module in (m for m in KNOWN if m.startswith("jobs")):
        inner = sorted(t for t in GRAPH[module] if t.startswith("pipeline") and t not in faces)
        assert not inner, f"{module} imports {inner}: import the package's face instead"


def test_no_import_cycle_among_the_product_modules():
    graph = {m: {t for t in GRAPH[m] if t in KNOWN and t != m} for m in KNOWN}
    state: dict[str, int] = {}  # 1 = on the path, 2 = done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(target):] + [target]))
            if target not in state:
                visit(target, path + [target])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_no_product_module_is_over_400_lines():
    long = {m: n for m, p in KNOWN.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long
