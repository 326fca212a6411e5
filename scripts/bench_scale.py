#!/usr/bin/env python
"""Scale simulation of the job runner: synthetic inputs through `python -m jobs.run`, with the
instant `builtin:echo` engine by default, so what is measured is planning, reading,
committing and bookkeeping, not a model.

    .venv/bin/python scripts/bench_scale.py --rows 100000 --rows 1000000            # local disk
    .venv/bin/python scripts/bench_scale.py --rows 100000 --s3                      # moto S3, requests counted
    .venv/bin/python scripts/bench_scale.py --rows 100000 --layout large --model builtin:tiny --bare
    .venv/bin/python scripts/bench_scale.py --rows 20000 --layout files --files 1000   # 1,000 files of 20 rows
    .venv/bin/python scripts/bench_scale.py --rows 20000 --layout files --files 1000 --id-column   # with and without
    .venv/bin/python scripts/bench_scale.py --id-check-rows 10000000   # the unique-id check alone, 10^7 ids

Each case writes its input (`files`: --files files of equal size; `large`: one file), runs the
job as a subprocess, and reports: wall time; the driver's peak RSS (VmHWM of the driver process,
polled); seconds from the command's start to the first committed part; steady-state rows/s
(first committed part to last); rows/s of each stage (planning tasks, reads, engine, commits:
rows over that stage's summed task time); per-shard fixed cost; manifest and index sizes; with
--s3, object-store requests per 1,000 rows by HTTP method, counted at a proxy in front of moto.
--bare also times the engine alone (LLMEngine.generate in-process) on the same prompts: with one
greedy SamplingParams, and with what a job sends (temperature 1.0, a seed per row).
--id-column runs each case twice, side by side: without input.id_column, then with it (the
unique-id check beside the work), and gives the ratio of their first-part times.
--id-check-rows N times the unique-id check alone (pipeline.run.shards.unique_ids.find_duplicate) on a
local Ray over N ids in 100 Parquet files: its wall time, the driver's peak RSS growth, and the
peak RSS of the Ray worker processes (polled; imports included).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def make_input(root: Path, rows: int, layout: str, files: int) -> Path:
    """JSONL of short prompts: `files` files of rows/files lines, or one file of `rows` lines."""
    folder = root / f"in-{layout}-{rows}-ids"
    if folder.exists():
        return folder
    folder.mkdir(parents=True)
    count = files if layout == "files" else 1
    per = -(-rows // count)
    for f in range(count):
        lines = range(f * per, min((f + 1) * per, rows))
        with open(folder / f"{f:06d}.jsonl", "w") as out:
            for start in range(lines.start, lines.stop, 100_000):
                out.write("".join(f'{{"id": "row-{i}", "prompt": "short prompt {i} of the scale test"}}\n'
                                  for i in range(start, min(start + 100_000, lines.stop))))
    return folder


def run_job(inp: str, out: str, args, extra: list[str], env: dict) -> dict:
    """Runs the job; returns its wall time, exit code and the driver's peak RSS."""
    cmd = [sys.executable, "-m", "jobs.run", "--model", args.model, "--input", inp, "--output", out,
           "--set", "sampling.max_tokens=1", "--set", f"workers.num={args.workers}", *extra]
    if args.shard_bytes:
        cmd += ["--set", f"workers.shard_bytes={args.shard_bytes}"]
    started = time.time()
    log = open(Path(tempfile.gettempdir()) / "bench_scale_job.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, _peak_rss_kb(proc.pid))
        time.sleep(0.2)
    return {"exit": proc.returncode, "wall_s": time.time() - started, "started": started,
            "driver_peak_rss_mb": peak / 1024}


def _peak_rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def measure(out_url: str, options: dict, job: dict) -> dict:
    """Figures from what the job left on storage: manifest, index, planning records."""
    from pipeline.io import OutputDir, Storage, entries

    out = OutputDir(Storage(out_url, options), "parquet")
    found = out.read_manifest()
    parts = sorted(entries(out, found), key=lambda e: e["committed_at"])
    manifest = found.to_dict()
    first, last = parts[0]["committed_at"], parts[-1]["committed_at"]
    steady_rows = sum(p["rows"] for p in parts[1:])
    index_bytes = sum(out.storage.fs.size(out.storage.path(manifest["index"]["dir"], f))
                      for f in manifest["index"]["files"])
    shards, rows = manifest["shards"], manifest["rows"]
    stage = {name: rows / (shards[f"mean_{name}_seconds"] * shards["count"]) if shards[f"mean_{name}_seconds"]
             else None for name in ("read", "engine", "commit")}
    plan = manifest.get("planning") or {}
    stage["planning"] = plan["rows"] / plan["seconds"] if plan.get("seconds") else None
    return {"rows": rows, "parts": len(parts), "first_part_s": first - job["started"],
            "steady_rows_per_s": steady_rows / (last - first) if last > first else None,
            "rows_per_s_overall": rows / job["wall_s"], "stage_rows_per_s": stage,
            "fixed_seconds_per_shard": shards["fixed_seconds_per_shard"],
            "mean_idle_seconds_per_shard": shards["mean_idle_seconds"],
            "manifest_bytes": len(json.dumps(manifest, indent=1, default=str)), "index_bytes": index_bytes,
            "index_files": len(manifest["index"]["files"]), "planning": plan}


def bare_engine(folder: Path, model: str, limit: int) -> dict:
    """Rows/s of the engine alone on the case's prompts (model load excluded)."""
    from engine import EngineConfig, SamplingParams
    from pipeline.tasks import build_engine, row_seed

    prompts = []
    for path in sorted(folder.iterdir()):
        prompts += [json.loads(line)["prompt"] for line in path.read_text().splitlines()]
    prompts = prompts[:limit]
    engine = build_engine(EngineConfig(model=model))
    started = time.perf_counter()
    for i in range(0, len(prompts), 4096):
        engine.generate(prompts[i:i + 4096], SamplingParams(max_tokens=1, temperature=0.0))
    shared = len(prompts) / (time.perf_counter() - started)
    # what a job sends: the spec's default temperature (1.0) and a seed per row, from its id
    started = time.perf_counter()
    for i in range(0, len(prompts), 4096):
        params = [SamplingParams(max_tokens=1, seed=row_seed(0, f"{i + j}")) for j in range(len(prompts[i:i + 4096]))]
        engine.generate(prompts[i:i + 4096], params)
    return {"bare_rows": len(prompts), "bare_rows_per_s": shared,
            "bare_rows_per_s_job_params": len(prompts) / (time.perf_counter() - started)}


class S3:
    """moto on loopback behind a proxy that counts requests by HTTP method."""

    def __enter__(self):
        import logging

        sys.path.insert(0, str(ROOT / "tests"))
        from chaos.proxy import FlakyProxy
        from services import moto_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
        self._server = moto_server()
        endpoint = self._server.__enter__()
        self.proxy = FlakyProxy(endpoint, every=10 ** 12)  # never fails: only counts
        threading.Thread(target=self.proxy.serve_forever, daemon=True).start()
        self.options = {"endpoint_url": self.proxy.url}
        return self

    def upload(self, folder: Path, bucket: str) -> str:
        import s3fs

        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": self.proxy.url})
        if not fs.exists(bucket):
            fs.mkdir(bucket)
        fs.put(str(folder) + "/", f"{bucket}/{folder.name}/", recursive=True)
        self.proxy.seen.clear()
        return f"s3://{bucket}/{folder.name}/"

    def __exit__(self, *exc):
        self.proxy.shutdown()
        self._server.__exit__(*exc)


def case(args, rows: int, layout: str, work: Path, s3: S3 | None, extra_args: tuple = ()) -> dict:
    folder = make_input(work, rows, layout, args.files)
    env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false")
    name = f"{layout}-{rows}-{int(time.time())}"
    if s3 is None:
        inp, out, options, extra = str(folder), str(work / "out" / name), {}, []
    else:
        inp, out, options = s3.upload(folder, "bench"), f"s3://bench/out/{name}/", s3.options
        extra = ["--set", f"input.storage_options={{endpoint_url: '{s3.proxy.url}'}}",
                 "--set", f"output.storage_options={{endpoint_url: '{s3.proxy.url}'}}"]
        env.pop("AWS_ENDPOINT_URL", None)
    job = run_job(inp, out, args, extra + list(extra_args), env)
    result = {"case": f"{layout} x{args.files if layout == 'files' else 1}{' ' + ' '.join(extra_args[1::2])}",
              "input_rows": rows,
              "storage": "s3" if s3 else "local", "model": args.model, **job}
    if job["exit"] == 0:
        result.update(measure(out, options, job))
    if s3 is not None:
        result["requests_per_1000_rows"] = {m: n * 1000 / rows for m, n in sorted(s3.proxy.seen.items())}
    if args.bare:
        result.update(bare_engine(folder, args.model, rows))
    return result


def id_check(rows: int, work: Path) -> dict:
    """The unique-id check alone over `rows` ids in 100 Parquet files, on a local Ray."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray

    from pipeline.io import Storage, list_inputs
    from pipeline.run.shards.planner import ShardPlan
    from pipeline.run.shards.unique_ids import find_duplicate
    from pipeline.spec import validate

    folder = work / f"ids-{rows}"
    if not folder.exists():
        folder.mkdir(parents=True)
        per = -(-rows // 100)
        for f in range(100):
            ids = [f"user-{i:012d}" for i in range(f * per, min(rows, (f + 1) * per))]
            pq.write_table(pa.table({"id": ids, "prompt": ["p"] * len(ids)}), folder / f"{f:03d}.parquet")
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR")
    spec = validate({"input": {"path": str(folder), "id_column": "id"}, "output": {"path": str(work / "unused")}})
    files = list_inputs(Storage(str(folder)), "auto")
    workers: dict[int, int] = {}
    done = threading.Event()

    def poll():
        import psutil

        while not done.is_set():
            for proc in psutil.process_iter(["pid", "cmdline"]):
                command = " ".join(proc.info["cmdline"] or [])
                if "default_worker.py" in command or command.startswith("ray::"):  # a worker names itself by its task
                    workers[proc.pid] = max(workers.get(proc.pid, 0), _peak_rss_kb(proc.pid))
            time.sleep(0.2)

    threading.Thread(target=poll, daemon=True).start()
    before = _peak_rss_kb(os.getpid())
    started = time.time()
    found = find_duplicate(spec, files, ShardPlan(None, 1 << 20))
    wall = time.time() - started
    done.set()
    return {"case": "unique-id check alone", "ids": rows, "files": 100, "wall_s": wall, "duplicate": found,
            "ids_per_s": rows / wall, "driver_peak_rss_growth_mb": (_peak_rss_kb(os.getpid()) - before) / 1024,
            "worker_peak_rss_mb": max(workers.values(), default=0) / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, action="append", help="input rows per case (repeatable); default 100000")
    ap.add_argument("--layout", choices=["files", "large", "both"], default="both")
    ap.add_argument("--files", type=int, default=1000, help="files of the `files` layout")
    ap.add_argument("--model", default="builtin:echo")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--shard-bytes", type=int, default=None)
    ap.add_argument("--s3", action="store_true", help="input and output on moto S3, requests counted")
    ap.add_argument("--bare", action="store_true", help="also time the engine alone on the same prompts")
    ap.add_argument("--id-column", action="store_true", help="each case without, then with input.id_column")
    ap.add_argument("--id-check-rows", type=int, help="time the unique-id check alone over this many ids")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "bench_scale")
    ap.add_argument("--json", type=Path, help="append the results to this JSON file")
    args = ap.parse_args()
    layouts = ["files", "large"] if args.layout == "both" else [args.layout]
    results = []
    if args.id_check_rows:
        results.append(id_check(args.id_check_rows, args.workdir))
        print(json.dumps(results[-1], default=str), flush=True)
    s3 = S3().__enter__() if args.s3 else None
    try:
        for rows in (args.rows or [100_000]) if not args.id_check_rows or args.rows else []:
            for layout in layouts:
                results.append(case(args, rows, layout, args.workdir, s3))
                print(json.dumps(results[-1], default=str), flush=True)
                if args.id_column:
                    results.append(case(args, rows, layout, args.workdir, s3, ("--set", "input.id_column=id")))
                    results[-1]["first_part_vs_without_id_column"] = (
                        results[-1].get("first_part_s", 0) / results[-2]["first_part_s"]
                        if results[-2].get("first_part_s") else None)
                    print(json.dumps(results[-1], default=str), flush=True)
    finally:
        if s3 is not None:
            s3.__exit__(None, None, None)
    if args.json:
        old = json.loads(args.json.read_text()) if args.json.exists() else []
        args.json.write_text(json.dumps(old + results, indent=1, default=str))
    os._exit(0)  # skip interpreter teardown (pyarrow + fsspec can abort in a destructor at exit)


if __name__ == "__main__":
    main()
