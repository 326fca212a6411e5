"""Shared fixtures: tiny random models of several architectures, built locally (no hub)."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Builtin models go to a per-session cache, so tests never touch the user's."""
    path = tmp_path_factory.mktemp("batchinfer-cache")
    old = os.environ.get("BATCHINFER_CACHE")
    os.environ["BATCHINFER_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("BATCHINFER_CACHE", None)
    else:
        os.environ["BATCHINFER_CACHE"] = old
