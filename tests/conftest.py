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


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto in server mode) on loopback, for the whole session.

    Credentials and the endpoint go into the environment before Ray starts, so the driver, the
    Ray workers and s3fs all talk to it the way they would talk to AWS."""
    import socket

    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield endpoint
    server.stop()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def ray_local(s3_server):
    """One local Ray for the session (start-up costs seconds); started after the S3 server so
    that workers inherit its endpoint and credentials."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()
