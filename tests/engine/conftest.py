from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from parity import ForgivenRows
from tiny_models import ARCHS, build_tiny_model  # noqa: E402  (tests/engine is on sys.path via rootdir)


@pytest.fixture(autouse=True)
def engine_device(request, monkeypatch):
    """Every engine test pins its device: a test marked gpu says its own; every other one runs on
    the CPU (its tolerances are float32's on CPU), even on a GPU machine, through device auto
    ($BATCHINFER_DEVICE, inherited by rank processes). `--engine-device cuda` runs them on the
    GPU in float32 instead (scripts/gpu_check.py's subset)."""
    if request.node.get_closest_marker("gpu") is not None:
        yield None
        return
    device = request.config.getoption("--engine-device")
    monkeypatch.setenv("BATCHINFER_DEVICE", device)
    if device == "cuda":
        from engine.runner import devices

        monkeypatch.setattr(devices, "auto_dtype", lambda device_type: "float32")
    yield device


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
