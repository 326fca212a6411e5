"""Fault scenarios: break a real job on purpose, rerun it, and count what came out.

    python -m jobs.chaos [SCENARIO ...] [--workdir DIR] [--json]

Each scenario runs `python -m jobs.run` (with its own local Ray) over a fresh input, injects
one fault (pipeline.chaos points, or a SIGKILL from outside), reruns the job when the first
attempt did not complete, and reports rows in, rows out, duplicate and lost ids, and the
outcome. A scenario passes when every input id is committed exactly once.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from pipeline.sink import OutputDir
from pipeline.storage import Storage

ROWS = 160
ROWS_PER_SHARD = 8


@dataclass
class Outcome:
    """What one scenario did to the output."""

    scenario: str
    rows_in: int
    rows_out: int
    duplicates: int
    lost: int
    outcome: str
    """How the job ended, e.g. "first run failed (exit 1) -> rerun completed"."""

    @property
    def ok(self) -> bool:
        return self.duplicates == 0 and self.lost == 0 and self.rows_out == self.rows_in \
            and self.outcome.endswith("completed")


def make_input(work: Path, rows: int = ROWS) -> list[str]:
    """Two JSONL files; returns the ids the job derives for their rows."""
    ids = []
    (work / "in").mkdir(parents=True, exist_ok=True)
    for f in range(2):
        lines = [json.dumps({"prompt": f"chaos {f}-{i} " + "x" * (i % 30)}) for i in range(rows // 2)]
        (work / "in" / f"{f}.jsonl").write_text("\n".join(lines) + "\n")
        ids += [f"{f}.jsonl:{i}" for i in range(rows // 2)]
    return ids


def job_args(inp: str, out: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "jobs.run", "--input", inp, "--output", out,
            "--set", f"workers.rows_per_batch={ROWS_PER_SHARD}", "--set", "sampling.max_tokens=24",
            "--set", "sampling.ignore_eos=true", *extra]


def start(args: list[str], log: Path, chaos: str | None = None, env: dict | None = None) -> subprocess.Popen:
    full_env = dict(os.environ if env is None else env)
    full_env.pop("BATCHINFER_CHAOS", None)
    if chaos:
        full_env["BATCHINFER_CHAOS"] = chaos
    return subprocess.Popen(args, stdout=log.open("a"), stderr=subprocess.STDOUT, start_new_session=True,
                            env=full_env, cwd=Path(__file__).resolve().parents[1])


def finish(proc: subprocess.Popen, timeout: float = 600) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return -9


def count(scenario: str, expected: list[str], out_url: str, outcome: str, options: dict | None = None) -> Outcome:
    """Ids in every committed part of the output, against the input's ids."""
    out = OutputDir(Storage(out_url, options or {}), "parquet")
    got: Counter = Counter()
    for key in out.done_keys():
        got.update(out.read_part(key)["id"].to_pylist())
    return Outcome(scenario, len(expected), sum(got.values()), sum(n - 1 for n in got.values() if n > 1),
                   len(set(expected) - set(got)), outcome)


def two_attempts(name: str, work: Path, chaos: str | None = None, kill_after_parts: int = 0,
                 inp: str | None = None, out: str | None = None, env: dict | None = None,
                 extra: tuple[str, ...] = ()) -> Outcome:
    """First attempt with the fault; a clean rerun if it did not complete."""
    expected = make_input(work)
    inp = inp or str(work / "in")
    out = out or str(work / "out")
    log = work / "job.log"
    started = time.time()
    proc = start(job_args(inp, out, *extra), log, chaos, env)
    if kill_after_parts:
        data = Path(out) / "data"
        while proc.poll() is None and len(list(data.glob("part-*")) if data.exists() else []) < kill_after_parts:
            time.sleep(0.1)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    code = finish(proc)
    first = f"first run exit {code} after {time.time() - started:.0f}s"
    if code == 0:
        return count(name, expected, out, f"{first} -> completed")
    code = finish(start(job_args(inp, out, *extra), log, None, env))
    return count(name, expected, out, f"{first} -> rerun {'completed' if code == 0 else f'exit {code}'}")


class FlakyProxy(ThreadingHTTPServer):
    """An HTTP proxy in front of an S3 endpoint that answers every `every`-th request of each
    method with 503 SlowDown (S3's throttling error) instead of forwarding it."""

    daemon_threads = True

    def __init__(self, upstream: str, every: int = 4):
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.every = every
        self.seen: Counter = Counter()
        self.failed: Counter = Counter()
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def should_fail(self, method: str) -> bool:
        with self.lock:
            self.seen[method] += 1
            fail = self.seen[method] % self.every == 0
            if fail:
                self.failed[method] += 1
            return fail


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            data = b""
            while True:
                size = int(self.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    return data
                data += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _handle(self) -> None:
        body = self._body()
        if self.server.should_fail(self.command):
            error = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                     b"<Message>Please reduce your request rate.</Message></Error>")
            self.send_response(503)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(error)))
            self.end_headers()
            self.wfile.write(error if self.command != "HEAD" else b"")
            return
        conn = http.client.HTTPConnection(*self.server.upstream, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("transfer-encoding", "expect")}
        headers["Content-Length"] = str(len(body))
        conn.request(self.command, self.path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        self.send_response(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                self.send_header(k, v)
        # HEAD answers carry the object's length, not the (empty) body's.
        length = resp.getheader("Content-Length") if self.command == "HEAD" else None
        self.send_header("Content-Length", length or str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        conn.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle


@contextmanager
def s3_server():
    """A moto S3 server on loopback with test credentials in the environment."""
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret",
           "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def s3_throttling(work: Path, every: int = 4) -> Outcome:
    """Input and output on S3 behind a proxy that throttles every `every`-th request."""
    import s3fs

    name = f"object storage 503 on every {every}th request"
    with s3_server() as endpoint:
        proxy = FlakyProxy(endpoint, every)
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        try:
            fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})
            fs.mkdir("chaos")
            expected = make_input(work)
            for f in (work / "in").iterdir():
                fs.put_file(str(f), f"chaos/in/{f.name}")
            opts = ["--set", f"input.storage_options={{endpoint_url: '{proxy.url}'}}",
                    "--set", f"output.storage_options={{endpoint_url: '{proxy.url}'}}"]
            env = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"}
            code = finish(start(job_args("s3://chaos/in/", "s3://chaos/out/", *opts), work / "job.log", env=env))
            injected = f"{sum(proxy.failed.values())} requests throttled ({dict(proxy.failed)})"
            outcome = f"first run exit {code}, {injected} -> {'completed' if code == 0 else 'failed'}"
            return count(name, expected, "s3://chaos/out/", outcome, {"endpoint_url": endpoint})
        finally:
            proxy.shutdown()


def node_loss(work: Path, replacement: bool, while_listing: bool = False) -> Outcome:
    """A local two-node cluster (ray.cluster_utils.Cluster): the actors start on the worker node,
    which is removed mid-job (or while the driver lists inputs); with `replacement` a new node
    joins, without it the actors move to the head. The driver runs in this process."""
    import ray
    from ray.cluster_utils import Cluster

    from jobs.spec import load_spec
    from pipeline.runner import run_job

    name = (f"worker node removed {'while listing' if while_listing else 'mid-job'}, "
            f"{'with' if replacement else 'no'} replacement")
    expected = make_input(work)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)
    events = []
    try:
        ray.init(address=cluster.address, logging_level="ERROR")
        head_id = ray.get_runtime_context().get_node_id()
        # Fill the head so the engine actors are placed on the worker node first.
        blocker = ray.remote(_Blocker).options(num_cpus=2, scheduling_strategy=ray.util.scheduling_strategies
                                   .NodeAffinitySchedulingStrategy(head_id, soft=False)).remote()
        ray.get(blocker.ready.remote())
        spec = load_spec(None, [f"workers.rows_per_batch={ROWS_PER_SHARD}", "sampling.max_tokens=24",
                                "sampling.ignore_eos=true", "workers.num=2", "workers.cpus=1"],
                         input=str(work / "in"), output=str(work / "out"))
        data = spec.model_dump(mode="json") | {"fingerprint": spec.fingerprint()}
        victim = cluster.list_all_nodes()[1]

        result: dict = {}

        def drive():  # the driver runs in a thread: Cluster.add_node must run in the main thread
            try:
                result["status"] = run_job(data, progress=lambda m: None).status
            except Exception as exc:  # noqa: BLE001  (reported in the table)
                result["error"] = str(exc)

        if while_listing:
            os.environ["BATCHINFER_CHAOS"] = "listed:sleep=4"
        driver = threading.Thread(target=drive, daemon=True)
        driver.start()
        parts = work / "out" / "data"
        if while_listing:
            time.sleep(1.5)
        else:
            while driver.is_alive() and len(list(parts.glob("part-*")) if parts.exists() else []) < 4:
                time.sleep(0.1)
        cluster.remove_node(victim)
        events.append("worker node removed")
        if replacement:
            cluster.add_node(num_cpus=2)
            events.append("replacement added")
        else:
            ray.kill(blocker)
            events.append("head freed")
        driver.join(timeout=600)
        os.environ.pop("BATCHINFER_CHAOS", None)
        if "status" in result:
            outcome = f"{result['status']} after {', '.join(events)} -> completed"
        else:
            outcome = f"failed after {', '.join(events)}: {result.get('error', 'timed out')}"
    finally:
        ray.shutdown()
        cluster.shutdown()
    return count(name, expected, str(work / "out"), outcome)


class _Blocker:
    """Holds the head node's CPUs (as a Ray actor) so the engine actors start elsewhere."""

    def ready(self) -> bool:
        return True


def scenarios(work: Path) -> dict:
    once = str(work / "once")
    return {
        "driver SIGKILL while listing": lambda: two_attempts("driver SIGKILL while listing", work / "a",
                                                             chaos="listed:kill"),
        "driver SIGKILL mid-generation": lambda: two_attempts("driver SIGKILL mid-generation", work / "b",
                                                              kill_after_parts=5),
        "driver SIGKILL before the manifest": lambda: two_attempts(
            "driver SIGKILL before the manifest", work / "c", chaos="generated:kill"),
        "driver SIGKILL before _SUCCESS": lambda: two_attempts("driver SIGKILL before _SUCCESS", work / "d",
                                                               chaos="manifest:kill"),
        "actor os._exit mid-shard, once": lambda: two_attempts("actor os._exit mid-shard, once", work / "e",
                                                               chaos=f"shard:exit:{once}-e"),
        "actor constructor fails": lambda: two_attempts("actor constructor fails", work / "f",
                                                        chaos="init:raise"),
        "object storage throttling": lambda: s3_throttling(work / "g"),
        "node removed mid-job, replaced": lambda: node_loss(work / "h", replacement=True),
        "node removed mid-job, not replaced": lambda: node_loss(work / "i", replacement=False),
        "node removed while listing": lambda: node_loss(work / "j", replacement=True, while_listing=True),
    }


def print_table(outcomes: list[Outcome]) -> None:
    print("| scenario | rows in | rows out | duplicates | lost | outcome |\n|---|---:|---:|---:|---:|---|")
    for o in outcomes:
        print(f"| {o.scenario} | {o.rows_in} | {o.rows_out} | {o.duplicates} | {o.lost} | {o.outcome} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="scenarios to run (default: all)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", action="store_true", help="print the outcomes as JSON instead of a table")
    ap.add_argument("--report", type=Path, help="also write the outcomes as JSON to this file")
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="batchinfer-chaos-"))
    table = scenarios(work)
    chosen = args.names or list(table)
    outcomes = []
    for name in chosen:
        print(f"running: {name}", file=sys.stderr, flush=True)
        outcomes.append(table[name]())
    data = [asdict(o) | {"ok": o.ok} for o in outcomes]
    if args.report:
        args.report.write_text(json.dumps(data, indent=1))
    if args.json:
        print(json.dumps(data, indent=1))
    else:
        print_table(outcomes)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: with fsspec and pyarrow loaded it can abort in a C++ destructor
    # ("terminate called without an active exception") after all the work is done.
    os._exit(0 if all(o.ok for o in outcomes) else 1)


if __name__ == "__main__":
    main()
