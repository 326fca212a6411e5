"""Shared fixtures: tiny random models of several architectures, built locally (no hub)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from services import environment, moto_server

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available() and "triton" not in sys.modules:
    # The Triton attention kernels' tests (tests/engine/test_triton_attention.py) run under the
    # interpreter without CUDA. Triton fixes a kernel's mode when the kernel is decorated, and
    # sentence-transformers and peft import triton: so before any test module is collected,
    # or those tests skip themselves in a whole-suite run (as they did in every CI run).
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        # Tests spread over processes (pytest -n N): each takes its share of the cores for torch's
        # math threads, so that N processes never run more spinning OpenMP threads than there are cores.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="I/K",
                     help="run only the I-th of K shares of the selected tests (0 <= I < K), dealt out in "
                          "collection order, so the cases of one parametrized test land in different shares")
    parser.addoption("--engine-device", default="cpu", choices=("cpu", "cuda"),
                     help="where tests/engine's tests not marked gpu build their engines (device auto): cpu, "
                          "or cuda in float32 for the subset scripts/gpu_check.py runs on a GPU")


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected: the share is of what is left
def pytest_collection_modifyitems(config, items):
    shard = config.getoption("--shard")
    if not shard:
        return
    try:
        i, k = (int(v) for v in shard.split("/"))
        assert 0 <= i < k
    except (ValueError, AssertionError):
        raise pytest.UsageError(f"--shard {shard!r}: expected I/K with 0 <= I < K") from None
    kept = [item for n, item in enumerate(items) if n % k == i]
    config.hook.pytest_deselected(items=[item for n, item in enumerate(items) if n % k != i])
    items[:] = kept


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Builtin models go to a per-session cache, and the Hugging Face cache is a per-session
    directory used offline, so tests never touch the user's caches or the network. Set before
    Ray starts, so that its workers see the same."""
    path = tmp_path_factory.mktemp("batchinfer-cache")
    with environment(BATCHINFER_CACHE=str(path), HF_HUB_CACHE=str(path / "hf-hub"), HF_HUB_OFFLINE="1"):
        yield path


@pytest.fixture(scope="session")
def hub_model():
    """publish(repo_id, src_dir, revision="main") -> commit: puts a model directory into the
    session's Hugging Face cache in the hub's own layout (blobs, snapshots/<commit> symlinks,
    refs/<revision>), as a download by huggingface_hub would have left it."""
    import hashlib
    import shutil
    from pathlib import Path

    from huggingface_hub.file_download import repo_folder_name

    def publish(repo_id: str, src: Path, revision: str = "main") -> str:
        repo = Path(os.environ["HF_HUB_CACHE"]) / repo_folder_name(repo_id=repo_id, repo_type="model")
        files = sorted(p for p in Path(src).iterdir() if p.is_file())
        commit = hashlib.sha1(repo_id.encode() + b"".join(f.name.encode() + f.read_bytes() for f in files)).hexdigest()
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True, exist_ok=True)
        (repo / "blobs").mkdir(exist_ok=True)
        for f in files:
            blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
            if not blob.exists():
                shutil.copyfile(f, blob)
            link = snapshot / f.name
            if not link.exists():
                link.symlink_to(os.path.relpath(blob, snapshot))
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / revision).write_text(commit)
        return commit

    return publish


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto in server mode) on loopback, for the whole session.

    Credentials and the endpoint go into the environment before Ray starts, so the driver, the
    Ray workers and s3fs all talk to it the way they would talk to AWS."""
    with moto_server(endpoint_env=True) as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def ray_local(s3_server):
    """One local Ray for the session (start-up costs seconds); started after the S3 server so
    that workers inherit its endpoint and credentials."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()
