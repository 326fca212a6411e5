"""The seam between the pipeline and the engine: the protocol `engine.api.Engine`, built by
`engine.build`. Read from the code (ast): the pipeline's task and shard code, `build_processor` and
the CLI ask an engine only what the protocol declares, import no engine implementation, and never
probe an engine with getattr or hasattr; each engine class has every protocol call
(tests/engine/test_engine_protocol.py runs them)."""
from __future__ import annotations

import ast
import inspect

import pytest

import engine
from engine.api import Engine, SteppingEngine
from import_graph import ROOT

SCOPE = [*(ROOT / "pipeline" / "tasks").glob("*.py"), *(ROOT / "pipeline" / "run" / "shards").glob("*.py"),
         ROOT / "pipeline" / "processor.py", *(ROOT / "jobs").glob("*.py")]
"""Where an engine is held (the issue's scope): other getattr uses (schemas, reports) hold no engine."""
ENGINE_NAMES = ("engine", "llm")
"""Identifiers that hold an engine in that code (self.engine, engine, llm)."""
FACE = set(engine.api.__all__) | {"build", "__version__"}
"""What the scope may import from `engine`: the protocol, its builder and engine.api's records."""


def _names(node: ast.AST) -> list[str]:
    """The identifiers of a name or attribute chain (self.engine.runner -> self, engine, runner)."""
    out = []
    while isinstance(node, ast.Attribute):
        out.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        out.append(node.id)
    return out


def _where(path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def probes(path) -> list[str]:
    """getattr / hasattr calls on an engine in one file, one line each."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and node.args and any(n.lower() in ENGINE_NAMES or n.lower().endswith("_engine")
                                      for n in _names(node.args[0])):
            found.append(f"{_where(path)}:{node.lineno}: {ast.unparse(node)}")
    return found


def engine_imports(path) -> list[str]:
    """Imports of the engine beyond its face and engine.api, one line each."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "engine":
            if node.module == "engine":
                bad += [f"{_where(path)}:{node.lineno}: from engine import {a.name}"
                        for a in node.names if a.name not in FACE]
            elif node.module != "engine.api":
                bad.append(f"{_where(path)}:{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Import):
            bad += [f"{_where(path)}:{node.lineno}: import {a.name}" for a in node.names
                    if a.name.split(".")[0] == "engine" and a.name not in ("engine", "engine.api")]
    return bad


def test_the_rule_sees_a_probe_and_a_reach_past_the_face(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from engine.llm_engine import LLMEngine\nfrom engine import EchoEngine, build\n"
                   "def f(self, llm):\n    getattr(self.engine, 'runner', None)\n    hasattr(llm, 'memory')\n"
                   "    getattr(schema, 'title', None)\n")
    assert len(probes(bad)) == 2 and len(engine_imports(bad)) == 2


def test_the_pipeline_asks_an_engine_only_through_the_protocol():
    assert len(SCOPE) > 20
    found = [line for path in SCOPE for line in probes(path) + engine_imports(path)]
    assert not found, "\n".join(found)


PROTOCOL_CALLS = [name for name, value in vars(Engine).items() if callable(value) and not name.startswith("_")]
STEP_CALLS = [name for name, value in vars(SteppingEngine).items() if callable(value) and not name.startswith("_")]


@pytest.mark.parametrize("name", ["LLMEngine", "EncoderEngine", "EchoEngine"])
def test_each_engine_has_every_protocol_call_with_its_parameters(name):
    cls = getattr(engine, name)
    calls = PROTOCOL_CALLS + (STEP_CALLS if name == "LLMEngine" else [])
    assert {"generate", "score_choices", "embed", "classify", "score", "encode_chat", "facts", "close",
            "refusal", "model_identity"} <= set(PROTOCOL_CALLS)
    for call in calls:
        want = list(inspect.signature(getattr(Engine if call in PROTOCOL_CALLS else SteppingEngine, call)).parameters)
        got = list(inspect.signature(getattr(cls, call)).parameters)
        assert got == want, f"{name}.{call}{got} against the protocol's {want}"
