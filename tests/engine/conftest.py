from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tiny_models import ARCHS, build_tiny_model  # noqa: E402  (tests/engine is on sys.path via rootdir)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """arch -> directory of a tiny random model of that architecture (built once per session)."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = build_tiny_model(arch, tmp_path_factory.mktemp(arch))
        return cache[arch]

    return get


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
