"""The engine's packages and the one direction of their imports, read from the code (ast): each
may import only the packages its row in MAY_IMPORT names (docs/architecture.md states them once,
from this table), and nothing below the top takes the engine itself. api and core never import torch,
transformers or a package that does; only runner, distributed and quantization import CUDA, Triton
or torch's extension builder. Outside engine/, the product and its scripts import the engine
through package faces alone. Every engine exception is declared in engine/api/errors.py and
exported by `engine`. Cycles and module length are checked for the whole product beside the
pipeline's rule (tests/pipeline/test_package_rule.py).
"""
from __future__ import annotations

import ast

import pytest

from import_graph import ROOT, declared_all, graph, modules

MAY_IMPORT = {
    "api": set(),
    "core": {"api"},
    "models": {"api"},
    "quantization": {"api"},
    "distributed": {"api"},
    "lora": {"api", "core", "models", "distributed"},
    "multimodal": {"api", "core", "models"},
    "runner": {"api", "core", "models", "quantization", "distributed", "lora", "multimodal"},
    "sample": {"api", "core", "models"},
    "pooling": {"api", "core", "models", "runner"},
    "structured": {"api", "core"},
}
"""The engine packages each package may import, besides itself; the top (llm_engine.py, encoder_engine.py, builder.py, choice_scoring.py,
echo.py and the face) may import any of them."""

TORCH_FREE = {"api", "core"}
DEVICE_CODE = {"runner", "distributed", "quantization"}
"""The packages that may import CUDA, Triton or torch's C++ extension builder."""
DEVICE_IMPORTS = ("triton", "torch.cuda", "torch.utils.cpp_extension")
KERNEL_MODULES = "engine.runner.kernels."
"""Kernel modules a script may reach directly (scripts/compile_kernels.py builds them)."""

KNOWN = modules()
SCRIPTS = modules(("scripts",))
GRAPH = graph({**KNOWN, **SCRIPTS})
PACKAGES = sorted(MAY_IMPORT)


def package(module: str) -> str | None:
    """The engine package a module belongs to: a name of MAY_IMPORT, "top", or None outside engine/."""
    parts = module.split(".")
    if parts[0] != "engine":
        return None
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in MAY_IMPORT) else "top"


def faces() -> set[str]:
    """The engine's package faces: `engine` and each of its packages' __init__."""
    return {"engine"} | {m for m, p in KNOWN.items() if m.startswith("engine.") and p.name == "__init__.py"}


def check_one_way(module: str, targets: set[str]) -> list[str]:
    """What `module` imports against the rule, one line each."""
    own, bad = package(module), []
    for target in sorted(targets):
        other = package(target) if target in KNOWN else None
        if own in MAY_IMPORT and other is not None and other != own and other not in MAY_IMPORT[own]:
            bad.append(f"{module} imports {target}: {own} may not import {other}")
        if own in MAY_IMPORT and other == "top":
            bad.append(f"{module} imports {target}: a package never imports the top of the engine")
        root = target.split(".")[0]
        if own in TORCH_FREE and (root in ("torch", "transformers") or (other is not None and other not in TORCH_FREE)):
            bad.append(f"{module} imports {target}: {own} is torch-free")
        if any(target == d or target.startswith(d + ".") for d in DEVICE_IMPORTS) and own not in DEVICE_CODE:
            bad.append(f"{module} imports {target}: only {', '.join(sorted(DEVICE_CODE))} import device code")
    return bad


def test_the_engine_has_its_packages_each_with_a_face_and_a_two_line_docstring():
    found = {m.split(".")[1] for m in KNOWN if package(m) in MAY_IMPORT}
    assert found == set(MAY_IMPORT)
    for name in PACKAGES:
        face = ROOT / "engine" / name / "__init__.py"
        doc = ast.get_docstring(ast.parse(face.read_text()))
        assert doc and len(doc.splitlines()) == 2, f"{face}: its docstring says in two lines what the package answers"
        assert declared_all(face), f"{face} declares no __all__"


@pytest.mark.parametrize("module", sorted(m for m in KNOWN if package(m) is not None))
def test_engine_imports_run_one_way(module):
    assert not check_one_way(module, GRAPH[module])


@pytest.mark.parametrize("module", sorted(m for m in {**KNOWN, **SCRIPTS} if package(m) is None))
def test_outside_the_engine_imports_go_through_its_faces(module):
    inner = sorted(t for t in GRAPH[module] if t.split(".")[0] == "engine" and t not in faces()
                   and not (module.startswith("scripts.") and t.startswith(KERNEL_MODULES)))
    assert not inner, f"{module} imports {inner}: import the package's face instead"


def test_the_rule_catches_a_bad_import():
    """The checks above fail on the imports they forbid (each as a module would write it)."""
    assert check_one_way("engine.core.scheduler", {"torch"})  # core is torch-free
    assert check_one_way("engine.core.scheduler", {"engine.runner.model_runner"})  # and below the runner
    assert check_one_way("engine.api.config", {"engine.models.tokenizer"})  # api imports no sibling
    assert check_one_way("engine.sample.sampler", {"engine.runner.attention"})  # sample does not run the model
    assert check_one_way("engine.runner.attention", {"engine.llm_engine"})  # nothing reaches up to the top
    assert check_one_way("engine.structured.grammar", {"triton"})  # device code stays in the runner
    assert not check_one_way("engine.runner.attention", {"engine.runner.kernels.triton_attention", "triton", "torch"})


def test_every_engine_exception_lives_in_api_errors_and_is_exported_by_engine():
    import engine
    from engine.api import errors

    tree = ast.parse((ROOT / "engine/api/errors.py").read_text())
    declared = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    for name in declared:
        cls = getattr(errors, name)
        assert issubclass(cls, Exception) and getattr(engine, name) is cls and name in engine.__all__
        doc = cls.__doc__ or ""
        assert "retry" in doc.lower(), f"{name}'s docstring says whether a retry can help"
    elsewhere = {f"{m}.{n.name}" for m, p in KNOWN.items() if package(m) is not None and m != "engine.api.errors"
                 for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ClassDef)
                 and any(isinstance(b, ast.Name) and (b.id.endswith(("Error", "Exception")) or b.id in declared)
                         for b in n.bases)}
    assert not elsewhere, f"exceptions declared outside engine/api/errors.py: {sorted(elsewhere)}"


ENGINE_NAMES = ("llm", "engine", "llm_engine")
"""Parameter names that hold an engine."""


def takes_the_engine(source: str) -> list[str]:
    """The functions of `source` that take an engine: a parameter named for one or annotated LLMEngine."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            if any(a.arg in ENGINE_NAMES or (a.annotation is not None and "LLMEngine" in ast.unparse(a.annotation))
                   for a in args):
                found.append(node.name)
    return found


@pytest.mark.parametrize("module", sorted(m for m in KNOWN if package(m) in MAY_IMPORT))
def test_nothing_below_the_top_takes_the_engine(module):
    """The packages take the pieces they use (engine.core.paged.PagedPass, a runner, a salt
    function), never the engine: an engine held below the top made a cycle, and `del llm` freed
    nothing until the cyclic collector ran."""
    assert not takes_the_engine(KNOWN[module].read_text()), f"{module}: {takes_the_engine(KNOWN[module].read_text())}"


def test_the_engine_rule_catches_a_function_taking_the_engine():
    assert takes_the_engine("def f(llm, rows):\n    pass\n") == ["f"]
    assert takes_the_engine("def f(x: 'LLMEngine'):\n    pass\n") == ["f"]
    assert not takes_the_engine("def f(paged, rows):\n    pass\n")
