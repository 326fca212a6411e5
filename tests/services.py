"""Services the tests and the chaos harness start for themselves: an S3-compatible server
(moto's server mode) on loopback, and environment variables set for a block."""
from __future__ import annotations

import contextlib
import os
import socket

S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret",
                  "AWS_DEFAULT_REGION": "us-east-1"}


@contextlib.contextmanager
def environment(**env: str):
    """Sets environment variables for the block, then restores what was there."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def moto_server(endpoint_env: bool = False):
    """A moto S3 server on loopback for the block, with test credentials in the environment;
    yields its endpoint URL. With `endpoint_env`, AWS_ENDPOINT_URL points at it too, so that
    clients not told the endpoint (Ray workers, pyarrow) reach it the way they would reach AWS."""
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = S3_CREDENTIALS | ({"AWS_ENDPOINT_URL": endpoint} if endpoint_env else {})
    try:
        with environment(**env):
            yield endpoint
    finally:
        server.stop()
