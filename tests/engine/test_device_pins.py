"""Every engine test pins its device, so a GPU machine never fails tolerances meant for float32 on a
CPU: a test marked `gpu` names CUDA itself; every other one runs on the CPU through device auto,
which tests/engine/conftest.py's autouse fixture pins ($BATCHINFER_DEVICE=cpu, or cuda in float32
under --engine-device cuda). Held statically over the test files, and by the fixture itself."""
from __future__ import annotations

import ast
import os
from pathlib import Path

import torch

from engine.runner.devices import resolve_device

HERE = Path(__file__).parent
SMALL_POOL = {"max_batch_tokens", "gpu_memory_utilization"}


def marked_gpu(decorators) -> bool:
    return any("gpu" in ast.unparse(d) and "mark" in ast.unparse(d) for d in decorators)


def module_marked_gpu(tree: ast.Module) -> bool:
    return any(isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets)
               and "mark.gpu" in ast.unparse(node.value) for node in tree.body)


def cuda_literal(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("cuda")


def engine_configs(fn: ast.FunctionDef):
    """(the EngineConfig call, the keywords it sets, its own and through **dict(...) names of the function)."""
    dicts = {}
    for node in ast.walk(fn):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "id", None) == "dict"):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    dicts[target.id] = {k.arg for k in node.value.keywords if k.arg}
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "EngineConfig":
            keys = {k.arg for k in node.keywords if k.arg}
            for k in node.keywords:
                if k.arg is None and isinstance(k.value, ast.Name):
                    keys |= dicts.get(k.value.id, set())
            yield node, keys


def test_cuda_is_named_only_by_tests_marked_gpu_and_their_engines_set_a_small_pool():
    unmarked, unbounded, gpu_tests = [], [], 0
    for path in sorted(HERE.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        whole = module_marked_gpu(tree)
        for fn in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]:
            gpu = whole or marked_gpu(fn.decorator_list)
            refused = {id(n) for w in ast.walk(fn) if isinstance(w, ast.With)
                       and any("raises" in ast.unparse(i.context_expr) for i in w.items) for n in ast.walk(w)}
            names_cuda = any(isinstance(n, ast.keyword) and n.arg == "device" and cuda_literal(n.value)
                             and id(n) not in refused for n in ast.walk(fn))  # a config refused builds nothing
            if names_cuda and not gpu:
                unmarked.append(f"{path.name}::{fn.name}")
            if gpu:
                gpu_tests += 1
                for call, keys in engine_configs(fn):
                    if not keys & SMALL_POOL:  # else it sizes its pool to 0.9 of the card, twice in a test
                        unbounded.append(f"{path.name}:{call.lineno}")
    assert not unmarked, f"tests naming CUDA without the gpu mark: {unmarked}"
    assert not unbounded, f"GPU tests' engines sized from the card (set max_batch_tokens): {unbounded}"
    assert gpu_tests >= 5


def test_the_fixture_pins_every_other_engine_test_to_the_cpu():
    assert os.environ["BATCHINFER_DEVICE"] == "cpu"
    assert resolve_device("auto") == torch.device("cpu")
