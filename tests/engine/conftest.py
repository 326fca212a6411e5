from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from parity import ForgivenRows
from tiny_models import ARCHS, build_tiny_model  # noqa: E402  (tests/engine is on sys.path via rootdir)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """(arch, eos_scale=None) -> directory of a tiny random model of that architecture (built once
    per session); see build_tiny_model for eos_scale."""
    cache = {}

    def get(arch: str, eos_scale: float | None = None):
        if (arch, eos_scale) not in cache:
            cache[arch, eos_scale] = build_tiny_model(arch, tmp_path_factory.mktemp(arch), eos_scale=eos_scale)
        return cache[arch, eos_scale]

    return get


@pytest.fixture(scope="module")
def forgiveness():
    """The module's tally of rows compared with transformers and rows forgiven as near-ties;
    the module fails (at teardown) when more than 1 in 50 were forgiven."""
    tally = ForgivenRows()
    yield tally
    tally.check()


@pytest.fixture(scope="session")
def reference_model():
    """arch dir -> transformers model in float32, for parity checks."""
    cache = {}

    def get(path):
        if path not in cache:
            cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return cache[path]

    return get


def pytest_configure(config):
    config.addinivalue_line("markers", "arch(name): tiny model architecture under test")


__all__ = ["ARCHS"]
