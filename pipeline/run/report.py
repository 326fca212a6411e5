"""Job accounting: counts over committed shards, per-worker figures, resource-hours and cost.

Used for manifest.json when a job completes, and by `batchinfer report` on a finished or
partial output (from its progress and run records alone)."""
from __future__ import annotations

from typing import Iterable

from pipeline.io import SUMMARY_FIELDS, CommitRecord, OutputDir, RunRecord, Storage, entries

TIMINGS = ("seconds", "read_seconds", "engine_seconds", "commit_seconds", "idle_seconds")
"""Per-shard times in a commit record: total, reading, the engine, committing, and the actor's
wait since its previous shard (Ray Data hand-over)."""


class PartTotals:
    """Sums over commit records / index entries, one at a time: counts, first error causes,
    per-worker figures, the per-shard fixed cost, and OOM retries. Memory grows with workers."""

    def __init__(self):
        self.totals = {k: 0 for k in SUMMARY_FIELDS}
        self.samples: list[str] = []
        self.workers: dict[str, dict] = {}
        self.shards = 0
        self.times = dict.fromkeys(TIMINGS, 0.0)
        self.oom = {"retries": 0, "shards": 0, "budgets": []}

    def add(self, s: CommitRecord) -> None:
        self.shards += 1
        for k in SUMMARY_FIELDS:
            self.totals[k] += getattr(s, k)
        if len(self.samples) < 5:
            self.samples += list(s.error_samples)[: 5 - len(self.samples)]
        for k in TIMINGS:
            self.times[k] += getattr(s, k)
        if s.oom_retries:
            self.oom["retries"] += s.oom_retries
            self.oom["shards"] += 1
            self.oom["budgets"] = sorted(set(self.oom["budgets"]) | set(s.oom_budgets))
        w = self.workers.setdefault(s.worker or "unknown",
                                    {"shards": 0, "rows": 0, "generated_tokens": 0, "seconds": 0.0})
        w["shards"] += 1
        w["rows"] += s.rows
        w["generated_tokens"] += s.generated_tokens
        w["seconds"] += s.seconds

    def shard_costs(self) -> dict:
        """Mean per-shard times; fixed_seconds = everything but the engine (read, prepare, commit)."""
        n = max(self.shards, 1)
        means = {f"mean_{k}": self.times[k] / n for k in TIMINGS}
        return {"count": self.shards, "mean_rows": self.totals["rows"] / n, **means,
                "fixed_seconds_per_shard": (self.times["seconds"] - self.times["engine_seconds"]) / n}

    def result(self) -> dict:
        for w in self.workers.values():
            w["tokens_per_second"] = w["generated_tokens"] / w["seconds"] if w["seconds"] else 0.0
        return {**self.totals, "error_samples": self.samples, "workers": self.workers,
                "shards": self.shard_costs(), "oom": self.oom}


def build_report(out: OutputDir, records: Iterable[CommitRecord], price_per_hour: float | None) -> dict:
    """Counts, per-worker figures, shard costs and cost over the commit records `records`."""
    totals = PartTotals()
    for record in records:
        totals.add(record)
    data = totals.result()
    return {**data, "usage": usage(out.read_runs(), data["generated_tokens"], price_per_hour)}


def usage(runs: list[RunRecord], generated_tokens: int, price_per_hour: float | None) -> dict:
    """Resource-hours over every run (crashed ones counted up to their last heartbeat) and cost."""
    hours: dict[str, float] = {}
    for r in runs:
        h = r.generate_seconds * r.workers * r.resource_per_actor / 3600
        hours[r.resource] = hours.get(r.resource, 0.0) + h
    gen_seconds = sum(r.generate_seconds for r in runs)
    result = {"runs": len(runs), "generate_seconds": gen_seconds,
              "wall_seconds": sum((r.finished or r.last_seen) - r.started for r in runs),
              "tokens_per_second": generated_tokens / gen_seconds if gen_seconds else 0.0,
              **{f"{k}_hours": v for k, v in hours.items()}}
    if price_per_hour is not None:
        cost = price_per_hour * sum(hours.values())
        result["price_per_hour"] = price_per_hour
        result["cost"] = cost
        result["cost_per_1m_generated_tokens"] = cost / generated_tokens * 1e6 if generated_tokens else None
    return result


def output_report(url: str, storage_options: dict | None = None) -> dict:
    """What an output directory says about its job, complete or not. A complete one is read
    through its part index; a partial one from the commit records of its committed shards."""
    storage = Storage(url, storage_options or {})
    job = OutputDir(storage, "parquet").read_json("_job.json")
    if job is None:
        raise FileNotFoundError(f"{url} holds no batchinfer job (no _job.json)")
    out = OutputDir(storage, job["spec"]["output"]["format"])
    manifest = out.read_json("manifest.json")
    price = job["spec"].get("report", {}).get("price_per_hour")
    if out.is_complete() and manifest and "index" in manifest:
        data = build_report(out, map(CommitRecord.from_dict, entries(out, manifest)), price)
        metrics = out.read_json("metrics.json") or {}
        if metrics.get("adapters"):  # a LoRA job: each metric's mean per adapter, to compare the fine-tunes
            data["adapters"] = {name: {"rows": group["rows"], **{m: v.get("mean") for m, v in group["metrics"].items()}}
                                for name, group in metrics["adapters"].items()}
        return {"output": url, "status": "complete", "shards_committed": data["shards"]["count"],
                "shards_planned": data["shards"]["count"], **data}
    keys = sorted(out.done_keys())
    data = build_report(out, (out.summary(k) for k in keys), price)
    status = "complete" if out.is_complete() else (manifest["status"] if manifest else "incomplete")
    return {"output": url, "status": status, "shards_committed": len(keys),
            "shards_planned": planned_shards(out, job), **data}


def planned_shards(out: OutputDir, job: dict) -> int | None:
    """Shards of the whole input, once every planning task has recorded its count (else None)."""
    if job.get("plan_blocks") is None:
        return job.get("shards_planned")  # layout 1 planned in the driver
    plan = out.plan_summary(job.get("plan_blocks"))
    return plan["shards"] if plan else None
