"""Fault scenarios: break a real job on purpose, rerun it, and count what came out.

    PYTHONPATH=tests python -m chaos.harness [SCENARIO ...] [--workdir DIR] [--json]   # scripts/chaos.sh

Each scenario runs `python -m jobs.run` (with its own local Ray) over a fresh input, injects
one fault (through pipeline.run.shards.chaos's hook into chaos.faults, a SIGKILL from outside, a throttling
proxy in front of S3, or a node removed from a cluster), reruns the job when the first attempt
did not complete, and reports rows in, rows out, duplicate and lost ids, the outcome, and the
evidence that the fault fired. A scenario passes when the fault fired and every input id is
committed exactly once.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from chaos.faults import read_records
from chaos.proxy import FlakyProxy
from pipeline.io import OutputDir, Storage
from services import environment, moto_server

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
ROWS = 160
ROWS_PER_SHARD = 8
KILLED = -signal.SIGKILL
"""A process's exit code after SIGKILL, as subprocess reports it."""


@dataclass
class Outcome:
    """What one scenario did to the output."""

    scenario: str
    rows_in: int
    rows_out: int
    duplicates: int
    lost: int
    outcome: str
    """How the job ended, e.g. "first run exit -9 after 12s -> rerun completed"."""
    evidence: dict = field(default_factory=dict)
    """What the fault left behind, e.g. {"first_exit": -9, "parts": 0}."""
    fired: bool = False
    """The evidence is what this fault leaves: without it, the counts prove nothing."""

    @property
    def ok(self) -> bool:
        return self.fired and self.duplicates == 0 and self.lost == 0 and self.rows_out == self.rows_in \
            and self.outcome.endswith("completed")


def python_path() -> str:
    """PYTHONPATH with tests/ first, so that `chaos` imports in jobs and their Ray workers."""
    paths = [str(TESTS), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return os.pathsep.join(dict.fromkeys(paths))


def hook_env(faults: str) -> dict:
    """The environment that turns pipeline.run.shards.chaos's hook on, with chaos.faults set to `faults`."""
    return {"BATCHINFER_CHAOS_HOOK": "chaos.faults", "BATCHINFER_CHAOS": faults, "PYTHONPATH": python_path()}


def make_input(work: Path, rows: int = ROWS) -> list[str]:
    """Two JSONL files; returns the ids the job derives for their rows."""
    ids = []
    (work / "in").mkdir(parents=True, exist_ok=True)
    for f in range(2):
        lines = [json.dumps({"prompt": f"chaos {f}-{i} " + "x" * (i % 30)}) for i in range(rows // 2)]
        (work / "in" / f"{f}.jsonl").write_text("\n".join(lines) + "\n")
        ids += [f"{f}.jsonl:{i}" for i in range(rows // 2)]
    return ids


MAX_TOKENS = 24
"""Tokens per row where a fault needs the job to be generating for a while (a kill mid-generation,
a node removed mid-job)."""
FEW_TOKENS = 4
"""Tokens per row where the fault fires at a named point, whatever the generation takes."""


def job_args(inp: str, out: str, *extra: str, tokens: int = MAX_TOKENS) -> list[str]:
    return [sys.executable, "-m", "jobs.run", "--model", "builtin:tiny", "--input", inp, "--output", out,
            "--set", f"workers.rows_per_batch={ROWS_PER_SHARD}", "--set", f"sampling.max_tokens={tokens}",
            "--set", "sampling.ignore_eos=true", *extra]


def start(args: list[str], log: Path, faults: str | None = None, env: dict | None = None) -> subprocess.Popen:
    full_env = {k: v for k, v in (os.environ if env is None else env).items() if not k.startswith("BATCHINFER_CHAOS")}
    if faults:
        full_env |= hook_env(faults)
    return subprocess.Popen(args, stdout=log.open("a"), stderr=subprocess.STDOUT, start_new_session=True,
                            env=full_env, cwd=ROOT)


def finish(proc: subprocess.Popen, timeout: float = 600) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return KILLED


def count(scenario: str, expected: list[str], out_url: str, outcome: str, evidence: dict, fired: bool,
          options: dict | None = None) -> Outcome:
    """Ids in every committed part of the output, against the input's ids."""
    out = OutputDir(Storage(out_url, options or {}), "parquet")
    got: Counter = Counter()
    for key in out.done_keys():
        got.update(out.read_part(key)["id"].to_pylist())
    return Outcome(scenario, len(expected), sum(got.values()), sum(n - 1 for n in got.values() if n > 1),
                   len(set(expected) - set(got)), outcome, evidence, fired)


def left_behind(out: Path) -> dict:
    """What an attempt left in a local output: committed parts, manifest, _SUCCESS."""
    data = out / "data"
    return {"parts": len(list(data.glob("part-*"))) if data.exists() else 0,
            "manifest": (out / "manifest.json").exists(), "success": (out / "_SUCCESS").exists()}


def two_attempts(name: str, work: Path, fired: Callable[[dict], bool], faults: str | None = None,
                 kill_after_parts: int = 0, tokens: int = MAX_TOKENS) -> Outcome:
    """First attempt with the fault; a clean rerun if it did not complete. `fired` judges the
    evidence of the first attempt: its exit code, what it left, the once-file, its log. `tokens`:
    generated per row."""
    expected = make_input(work)
    inp, out, log = str(work / "in"), work / "out", work / "job.log"
    started = time.time()
    proc = start(job_args(inp, str(out), tokens=tokens), log, faults)
    if kill_after_parts:
        while proc.poll() is None and left_behind(out)["parts"] < kill_after_parts:
            time.sleep(0.1)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    code = finish(proc)
    evidence = {"first_exit": code, **left_behind(out), "fault_logged": "injected fault at" in log.read_text()}
    once = (faults or "").split(":")[2:]
    if once:
        evidence["once_file"] = Path(once[0]).exists()
    first = f"first run exit {code} after {time.time() - started:.0f}s"
    if code == 0:
        return count(name, expected, str(out), f"{first} -> completed", evidence, fired(evidence))
    code = finish(start(job_args(inp, str(out), tokens=tokens), log))
    return count(name, expected, str(out), f"{first} -> rerun {'completed' if code == 0 else f'exit {code}'}",
                 evidence, fired(evidence))


def s3_throttling(name: str, work: Path, every: int = 4) -> Outcome:
    """Input and output on S3 behind a proxy that throttles every `every`-th request."""
    import s3fs

    with moto_server() as endpoint:
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
            code = finish(start(job_args("s3://chaos/in/", "s3://chaos/out/", *opts, tokens=FEW_TOKENS), work / "job.log",
                                env=env))
            throttled = sum(proxy.failed.values())
            evidence = {"first_exit": code, "throttled": throttled, "throttled_by_method": dict(proxy.failed)}
            outcome = f"first run exit {code}, {throttled} requests throttled -> {'completed' if code == 0 else 'failed'}"
            return count(name, expected, "s3://chaos/out/", outcome, evidence, throttled > 0,
                         {"endpoint_url": endpoint})
        finally:
            proxy.shutdown()


def descendants(root: int) -> dict[int, str]:
    """pid -> command line of every live process below `root`, then ` comm=` its process name (read
    from /proc: a tensor-parallel rank forked from the engine's fork server names itself
    batchinfer-tp<rank>, its command line the fork server's)."""
    parents, commands = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            comm = (entry / "comm").read_text().strip()
            commands[int(entry.name)] = f"{command.decode(errors='replace')} comm={comm}"
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    below, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in below:
                below[child] = commands.get(child, "")
                frontier.append(child)
    return below


def tp_rank_kill(name: str, work: Path) -> Outcome:
    """A job with engine.tensor_parallel_size 2 on CPU: once a part is committed, the engine
    actor's rank process is SIGKILLed. The worker rebuilds its engine (a new rank) and redoes
    the shard; the job completes in one run, every id once, and no rank process is left."""
    expected = make_input(work)
    inp, out, log = str(work / "in"), work / "out", work / "job.log"
    proc = start(job_args(inp, str(out), "--set", "engine.tensor_parallel_size=2", "--set", "workers.num=1",
                          "--set", "engine.distributed_timeout_s=10", tokens=FEW_TOKENS), log)
    victim, seen = None, set()
    while proc.poll() is None:  # watch the ranks to the end: the rebuilt engine's count as seen too
        ranks = [pid for pid, cmd in descendants(proc.pid).items() if " comm=batchinfer-tp" in cmd]
        seen.update(ranks)
        if victim is None and ranks and left_behind(out)["parts"] >= 1:
            victim = ranks[0]
            os.kill(victim, signal.SIGKILL)
        time.sleep(0.1)
    code = finish(proc)
    alive = [pid for pid in seen if Path(f"/proc/{pid}").exists()]
    evidence = {"first_exit": code, "killed_rank": victim, "rank_pids_seen": len(seen), "ranks_left": len(alive)}
    outcome = f"first run exit {code}, rank {victim} killed -> {'completed' if code == 0 else 'failed'}"
    fired = victim is not None and len(seen) >= 2 and not alive  # a second rank: the engine was rebuilt
    return count(name, expected, str(out), outcome, evidence, fired)


def node_loss(name: str, work: Path, replacement: bool, while_listing: bool = False) -> Outcome:
    """A local two-node cluster (ray.cluster_utils.Cluster): the actors start on the worker node,
    which is removed mid-job (or while the driver lists inputs); with `replacement` a new node
    joins, without it the actors move to the head. The driver runs in this process; the hook
    records where and when each actor started and each shard ran."""
    import ray
    from ray.cluster_utils import Cluster

    from jobs.spec import load_spec
    from pipeline.run import run_job

    expected = make_input(work)
    records = str(work / "records.jsonl")
    faults = f"init:record={records};shard:record={records}"
    if while_listing:
        faults += f";listed:record={records};listed:sleep=4"
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
        spec = load_spec(None, [f"workers.rows_per_batch={ROWS_PER_SHARD}", f"sampling.max_tokens={MAX_TOKENS}",
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

        with environment(**hook_env(faults)):
            driver = threading.Thread(target=drive, daemon=True)
            driver.start()
            if while_listing:  # the driver sleeps 4 s right after listing
                while driver.is_alive() and not any(r["point"] == "listed" for r in read_records(records)):
                    time.sleep(0.1)
            else:
                while driver.is_alive() and left_behind(work / "out")["parts"] < 4:
                    time.sleep(0.1)
            removed_at = time.time()
            cluster.remove_node(victim)
            events.append("worker node removed")
            if replacement:
                cluster.add_node(num_cpus=2)
                events.append("replacement added")
            else:
                ray.kill(blocker)
                events.append("head freed")
            driver.join(timeout=600)
        if "status" in result:
            outcome = f"{result['status']} after {', '.join(events)} -> completed"
        else:
            outcome = f"failed after {', '.join(events)}: {result.get('error', 'timed out')}"
    finally:
        ray.shutdown()
        cluster.shutdown()
    evidence = placement(read_records(records), str(victim.node_id), removed_at)
    if while_listing:
        fired = evidence["listed_before_removal"] and evidence["inits_before_removal"] == 0 \
            and evidence["inits_after_removal"] > 0
    else:
        fired = evidence["shards_on_removed_node"] > 0 and evidence["inits_after_removal"] > 0
    return count(name, expected, str(work / "out"), outcome, evidence, fired)


def placement(records: list[dict], victim: str, removed_at: float) -> dict:
    """Where the actors ran, against the removed node and the time it went."""
    def n(point: str, test) -> int:
        return sum(1 for r in records if r["point"] == point and test(r))

    return {"shards_on_removed_node": n("shard", lambda r: r["node"] == victim),
            "inits_before_removal": n("init", lambda r: r["time"] < removed_at),
            "inits_after_removal": n("init", lambda r: r["time"] > removed_at and r["node"] != victim),
            "listed_before_removal": n("listed", lambda r: r["time"] < removed_at) > 0}


class _Blocker:
    """Holds the head node's CPUs (as a Ray actor) so the engine actors start elsewhere."""

    def ready(self) -> bool:
        return True


def killed_at(ev: dict, parts: bool, manifest: bool, success: bool = False) -> bool:
    """The first attempt died by SIGKILL and left parts / a manifest / _SUCCESS as expected."""
    return ev["first_exit"] == KILLED and (ev["parts"] > 0) == parts and ev["manifest"] == manifest \
        and ev["success"] == success


def scenarios(work: Path) -> dict[str, Callable[[], Outcome]]:
    """Each scenario by name; each works in its own folder of `work`."""
    once = str(work / "once")
    table = [
        ("driver SIGKILL while listing", "a", two_attempts,
         dict(faults="listed:kill", fired=lambda ev: killed_at(ev, parts=False, manifest=False), tokens=FEW_TOKENS)),
        ("driver SIGKILL mid-generation", "b", two_attempts,
         dict(kill_after_parts=5, fired=lambda ev: killed_at(ev, parts=True, manifest=False))),
        ("driver SIGKILL before the manifest", "c", two_attempts,
         dict(faults="generated:kill", fired=lambda ev: killed_at(ev, parts=True, manifest=False), tokens=FEW_TOKENS)),
        ("driver SIGKILL before _SUCCESS", "d", two_attempts,
         dict(faults="manifest:kill", fired=lambda ev: killed_at(ev, parts=True, manifest=True), tokens=FEW_TOKENS)),
        ("actor os._exit mid-shard, once", "e", two_attempts,
         dict(faults=f"shard:exit:{once}-e", fired=lambda ev: ev["once_file"] and ev["first_exit"] == 0,
              tokens=FEW_TOKENS)),
        ("actor constructor fails", "f", two_attempts,
         dict(faults="init:raise", fired=lambda ev: ev["first_exit"] == 1 and ev["fault_logged"], tokens=FEW_TOKENS)),
        ("object storage throttling", "g", s3_throttling, {}),
        ("tensor-parallel rank SIGKILL mid-shard", "k", tp_rank_kill, {}),
        ("node removed mid-job, replaced", "h", node_loss, dict(replacement=True)),
        ("node removed mid-job, not replaced", "i", node_loss, dict(replacement=False)),
        ("node removed while listing", "j", node_loss, dict(replacement=True, while_listing=True)),
    ]
    return {name: (lambda name=name, sub=sub, run=run, kw=kw: run(name, work / sub, **kw))
            for name, sub, run, kw in table}


def print_table(outcomes: list[Outcome]) -> None:
    print("| scenario | rows in | rows out | duplicates | lost | outcome | fault fired |\n"
          "|---|---:|---:|---:|---:|---|---|")
    for o in outcomes:
        shown = ", ".join(f"{k} {v}" for k, v in o.evidence.items() if not isinstance(v, dict))
        print(f"| {o.scenario} | {o.rows_in} | {o.rows_out} | {o.duplicates} | {o.lost} | {o.outcome} | "
              f"{'yes' if o.fired else 'NO'} ({shown}) |")


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
