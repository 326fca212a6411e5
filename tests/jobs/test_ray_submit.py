"""`ray job submit` against a real local cluster (`ray start --head`): the job runs where Ray
puts it, connects to that cluster, and ends SUCCEEDED with complete output, or FAILED with the
cause in its logs."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import read_output, write_jsonl

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# Ray 2.5x clusters require a token by default; clients send it only in token mode.
CLIENT_ENV = {"RAY_AUTH_MODE": "token"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, monkeypatch_module):
    """A head node in its own process group (stopped by killing the group, never `ray stop`,
    which would also stop the test session's own Ray)."""
    temp = tmp_path_factory.mktemp("ray")
    port, dash, client_port = free_port(), free_port(), free_port()
    # Every agent port explicit: the test session's own Ray already holds the defaults (52365, ...).
    agent_ports = [f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
                   f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}"]
    # The node's `python` is this environment's, as on a cluster image with batchinfer installed.
    env = os.environ | {"RAY_USAGE_STATS_ENABLED": "0", "PATH": f"{BIN}:{os.environ.get('PATH', '')}"}
    env.pop("RAY_ADDRESS", None)
    log = (temp / "head.log").open("w")
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", f"--port={port}", f"--dashboard-port={dash}",
         "--dashboard-host=127.0.0.1", "--num-cpus=2", f"--temp-dir={temp}", "--include-dashboard=true",
         f"--ray-client-server-port={client_port}", *agent_ports,
         "--disable-usage-stats"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        for address, client in _connect(f"http://127.0.0.1:{dash}", temp, monkeypatch_module):
            yield address, client, port
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=5)  # `ray start --block` may linger after SIGTERM: then the group is killed
        except subprocess.TimeoutExpired:
            pass
        os.killpg(head.pid, signal.SIGKILL) if _group_alive(head.pid) else None


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _connect(address, temp, monkeypatch_module):
    for key, value in CLIENT_ENV.items():
        monkeypatch_module.setenv(key, value)
    from ray.job_submission import JobSubmissionClient

    deadline = time.time() + 120
    client = None
    while time.time() < deadline and client is None:
        try:
            client = JobSubmissionClient(address)
        except Exception:  # noqa: BLE001  (dashboard not up yet)
            time.sleep(1)
    assert client is not None, (temp / "head.log").read_text()
    warm = None
    while time.time() < deadline and warm is None:  # the job agent comes up after the dashboard
        try:
            warm = client.submit_job(entrypoint="python -c pass")
        except RuntimeError:
            time.sleep(1)
    assert warm is not None, (temp / "head.log").read_text()
    wait(client, warm)
    yield address, client


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def wait(client, job_id, timeout=600):
    from ray.job_submission import JobStatus

    deadline = time.time() + timeout
    while time.time() < deadline:
        status = client.get_job_status(job_id)
        if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
            return status
        time.sleep(1)
    raise AssertionError(f"job {job_id} still {status} after {timeout}s:\n{client.get_job_logs(job_id)}")


def test_submit_with_the_cli_succeeds_with_complete_output(cluster, tmp_path):
    address, client, _ = cluster
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"submitted {i}"} for i in range(20)])
    out = tmp_path / "out"
    cmd = [str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", str(REPO),
           "--submission-id", "batchinfer-ok", "--", "python", "-m", "jobs.run", "--model", "builtin:tiny", "--input",
           str(tmp_path / "in.jsonl"), "--output", str(out), "--set", "sampling.max_tokens=4",
           "--set", "workers.rows_per_batch=7"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env=os.environ | CLIENT_ENV | {"RAY_ADDRESS": ""})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    from ray.job_submission import JobStatus

    assert wait(client, "batchinfer-ok") == JobStatus.SUCCEEDED
    assert sorted(read_output(out)["id"].to_pylist()) == sorted(f"in.jsonl:{i}" for i in range(20))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["rows"] == 20 and (out / "_SUCCESS").exists()
    logs = client.get_job_logs("batchinfer-ok")
    assert "rows" in logs and "20" in logs
    assert "core_worker" not in logs and " WARNING " not in logs, logs  # Ray's own lines go to a log file


def test_a_failing_job_ends_failed_with_the_cause_in_its_logs(cluster, tmp_path):
    _, client, _ = cluster
    from ray.job_submission import JobStatus

    job_id = client.submit_job(
        entrypoint=f"python -m jobs.run --input {tmp_path / 'missing.jsonl'} --output {tmp_path / 'out'}",
        runtime_env={"working_dir": str(REPO)}, submission_id="batchinfer-bad-input")
    assert wait(client, job_id) == JobStatus.FAILED
    assert "error: input not found" in client.get_job_logs(job_id)


def test_a_failed_shard_ends_the_job_with_its_cause_in_its_logs(cluster, tmp_path):
    """The shard fails in an engine actor; its cause still reaches the job's logs in one line."""
    _, client, _ = cluster
    from ray.job_submission import JobStatus

    (tmp_path / "bad.jsonl").write_text('{"prompt": "fine"}\n{not json\n')
    job_id = client.submit_job(
        entrypoint=f"python -m jobs.run --input {tmp_path / 'bad.jsonl'} --output {tmp_path / 'out'} "
                   "--set model=builtin:echo --set input.on_bad_line=fail",
        runtime_env={"working_dir": str(REPO)}, submission_id="batchinfer-bad-shard")
    assert wait(client, job_id) == JobStatus.FAILED
    logs = client.get_job_logs(job_id)
    assert "error: bad.jsonl line 2: malformed JSON" in logs, logs


def test_run_with_address_uses_the_existing_cluster(cluster, tmp_path):
    """`batchinfer run --address HOST:PORT` drives the job from here on the running cluster."""
    _, client, gcs_port = cluster
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"attached {i}"} for i in range(6)])
    out = tmp_path / "out"
    done = subprocess.run([str(BIN / "batchinfer"), "run", "--address", f"127.0.0.1:{gcs_port}", "--model", "builtin:tiny", "--input",
                           str(tmp_path / "in.jsonl"), "--output", str(out), "--set", "sampling.max_tokens=3"],
                          capture_output=True, text=True, timeout=600, env=os.environ | CLIENT_ENV)
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads((out / "manifest.json").read_text())["rows"] == 6
    drivers = [j for j in client.list_jobs() if j.type.name == "DRIVER"]
    assert drivers, "the run should show up as a driver job of the existing cluster"
