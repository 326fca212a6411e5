"""Job accounting: counts over committed shards, per-worker figures, resource-hours and cost.

Used for manifest.json when a job completes, and by `batchinfer report` on a finished or
partial output (from its progress and run records alone)."""
from __future__ import annotations

import json
import posixpath
import time

from pipeline.sink import SUMMARY_FIELDS, OutputDir


def new_run(spec: dict, run_id: str) -> dict:
    """The record of one run of a job (written under _runs/ while it goes, for accounting)."""
    import os

    workers = spec["workers"]
    per_actor = workers["gpus"] or max(1, (os.cpu_count() or 1) // workers["num"])
    return {"run_id": run_id, "started": time.time(), "last_seen": time.time(), "finished": None,
            "status": "running", "generate_started": None, "generate_seconds": 0.0,
            "workers": workers["num"], "resource": "gpu" if workers["gpus"] else "cpu_core",
            "resource_per_actor": per_actor, **{k: 0 for k in SUMMARY_FIELDS}}


def touch_run(run: dict) -> None:
    """Brings the run's clock fields up to now (while it is still running)."""
    if run["finished"] is not None:
        return
    now = time.time()
    run["last_seen"] = now
    if run["generate_started"] is not None:
        run["generate_seconds"] = now - run["generate_started"]


def write_run(out: OutputDir, run: dict) -> None:
    touch_run(run)
    out.storage.write_atomic(out.storage.path("_runs", f"{run['run_id']}.json"), json.dumps(run).encode())


def read_runs(out: OutputDir) -> list[dict]:
    runs = []
    for path in out.storage.list(out.storage.path("_runs")):
        if posixpath.basename(path).endswith(".json"):
            runs.append(json.loads(out.storage.read_text(path)))
    return sorted(runs, key=lambda r: r["started"])


def build_report(out: OutputDir, keys, price_per_hour: float | None) -> dict:
    """Counts, parts, per-worker figures and cost over the committed shards `keys`."""
    parts, totals, samples, workers = [], {k: 0 for k in SUMMARY_FIELDS}, [], {}
    for key in keys:
        s = out.summary(key)
        for k in SUMMARY_FIELDS:
            totals[k] += s.get(k, 0)
        samples += s.get("error_samples", [])
        parts.append({"path": out.storage.uri(out.part_path(key)), "shard": key, "rows": s["rows"],
                      "file": s.get("file"), "start": s.get("start"), "stop": s.get("stop")})
        w = workers.setdefault(s.get("worker", "unknown"), {"shards": 0, "rows": 0, "generated_tokens": 0,
                                                             "seconds": 0.0})
        w["shards"] += 1
        w["rows"] += s["rows"]
        w["generated_tokens"] += s["generated_tokens"]
        w["seconds"] += s.get("seconds", 0.0)
    for w in workers.values():
        w["tokens_per_second"] = w["generated_tokens"] / w["seconds"] if w["seconds"] else 0.0
    return {**totals, "error_samples": samples[:5], "parts": parts, "workers": workers,
            "usage": usage(read_runs(out), totals["generated_tokens"], price_per_hour)}


def usage(runs: list[dict], generated_tokens: int, price_per_hour: float | None) -> dict:
    """Resource-hours over every run (crashed ones counted up to their last heartbeat) and cost."""
    hours: dict[str, float] = {}
    for r in runs:
        h = r["generate_seconds"] * r["workers"] * r["resource_per_actor"] / 3600
        hours[r["resource"]] = hours.get(r["resource"], 0.0) + h
    gen_seconds = sum(r["generate_seconds"] for r in runs)
    result = {"runs": len(runs), "generate_seconds": gen_seconds,
              "wall_seconds": sum((r["finished"] or r["last_seen"]) - r["started"] for r in runs),
              "tokens_per_second": generated_tokens / gen_seconds if gen_seconds else 0.0,
              **{f"{k}_hours": v for k, v in hours.items()}}
    if price_per_hour is not None:
        cost = price_per_hour * sum(hours.values())
        result["price_per_hour"] = price_per_hour
        result["cost"] = cost
        result["cost_per_1m_generated_tokens"] = cost / generated_tokens * 1e6 if generated_tokens else None
    return result


def output_report(url: str, storage_options: dict | None = None) -> dict:
    """What an output directory says about its job, complete or not."""
    from pipeline.storage import Storage

    storage = Storage(url, storage_options or {})
    job = None
    for fmt in ("parquet", "jsonl"):
        out = OutputDir(storage, fmt)
        job = out.read_json("_job.json")
        if job is not None:
            break
    if job is None:
        raise FileNotFoundError(f"{url} holds no batchinfer job (no _job.json)")
    out = OutputDir(storage, job["spec"]["output"]["format"])
    manifest = out.read_json("manifest.json")
    keys = sorted(out.done_keys())
    data = build_report(out, keys, job["spec"].get("report", {}).get("price_per_hour"))
    status = manifest["status"] if manifest else "incomplete"
    if out.is_complete():
        status = "complete"
    return {"output": url, "status": status, "shards_committed": len(keys),
            "shards_planned": job.get("shards_planned"), **data}
