"""`batchinfer tune`: runs a sample of a job's own input through the engine at a small grid of
max_batch_tokens x max_num_seqs x scheduling, measures each, and recommends a setting that fits
a memory limit.

Each setting gets a fresh engine in this process (the model is loaded once per setting), set up
as one of the job's actors: on CPU it gets the torch threads of one of `workers.num` engines
sharing the cores, so the figures are one engine's. What is measured, per setting, over the
sample (all requests queued at t=0, as in a job):
  throughput  generated and total (prompt + generated) tokens per second of wall time;
  TTFT        time from the start to each request's first token (mostly queueing, offline);
  peak KV     most KV-cache slots reserved at once (rows x widest row, from the engine's batch
              statistics) x bytes per slot (2 x layers x KV heads x head dim x dtype size);
  peak mem    peak device memory allocated on CUDA; on CPU the peak resident set of this
              process while the setting ran (sampled every 10 ms), model weights included.
"""
from __future__ import annotations

import gc
import itertools
import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from engine.api import CPU_POOL_TOKENS

from jobs.spec import JobSpec

if TYPE_CHECKING:
    from pipeline.spec import Row

SCHEDULING = ("static", "continuous")
DEFAULT_ROWS = 256
"""Rows of the job's input run at each setting."""
MIN_SECONDS, REPEATS = 3.0, 3
"""A setting whose sample runs in under MIN_SECONDS is run up to REPEATS times (median kept)."""
NEAR_BEST = 0.05
"""Settings this close to the fastest count as fast as it; the smallest of them is recommended."""


@dataclass(frozen=True)
class Setting:
    """One point of the grid: the engine knobs that shape batches."""

    max_batch_tokens: int
    max_num_seqs: int
    scheduling: str

    def flags(self) -> str:
        return " ".join(f"--set engine.{k}={v}" for k, v in self.__dict__.items())


@dataclass
class Measurement:
    """What one setting did with the sample."""

    setting: Setting
    seconds: float
    """Wall time of the sample, engine loading excluded."""
    rows: int
    errors: int
    """Rows the engine refused (e.g. prompt + max_tokens above max_batch_tokens) or failed."""
    prompt_tokens: int
    generated_tokens: int
    ttft: list[float] = field(default_factory=list)
    """Seconds from the start to each generated request's first token."""
    peak_kv_tokens: int | None = None
    """Most KV tokens held at once: blocks in use x block size (None: the task generated nothing)."""
    kv_bytes_per_token: int = 0
    peak_memory_bytes: int = 0
    memory: dict = field(default_factory=dict)
    """The engine's own figures (`LLMEngine.memory`): KV pool blocks and bytes, weights' bytes, quantization."""

    @property
    def peak_kv_bytes(self) -> int | None:
        return self.peak_kv_tokens * self.kv_bytes_per_token if self.peak_kv_tokens else None

    @property
    def generated_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0

    @property
    def total_per_s(self) -> float:
        return (self.prompt_tokens + self.generated_tokens) / self.seconds if self.seconds else 0.0

    @property
    def rate(self) -> float:
        """What settings are ranked by: generated tokens/s, or total tokens/s for choice scoring
        (which generates none)."""
        return self.generated_per_s or self.total_per_s


def make_grid(spec: JobSpec, max_batch_tokens: list[int] | None = None, max_num_seqs: list[int] | None = None,
              scheduling: list[str] | tuple[str, ...] = SCHEDULING) -> list[Setting]:
    """Every combination of the given values; an axis left out takes the spec's value and one
    other: max_batch_tokens x 1 and 2, max_num_seqs x 1/4 and 1 (8 settings with both modes)."""
    mbt, mns = spec.engine.max_batch_tokens or CPU_POOL_TOKENS, spec.engine.max_num_seqs
    bad = [m for m in scheduling if m not in SCHEDULING]
    if bad or not scheduling:
        raise ValueError(f"scheduling must be among {', '.join(SCHEDULING)}, got {', '.join(bad) or 'none'}")
    mbt_values = max_batch_tokens or [mbt, mbt * 2]
    mns_values = max_num_seqs or [max(1, mns // 4), mns]
    return [Setting(*point) for point in itertools.product(sorted(set(mbt_values)), sorted(set(mns_values)),
                                                            dict.fromkeys(scheduling))]


def sample_rows(spec: JobSpec, n: int) -> list[Row]:
    """The first `n` readable rows of the job's input, with their ids (lines that do not parse
    are left out)."""
    from pipeline.io import Storage, list_inputs, plan_shards, read_shard

    storage = Storage(spec.input.path, spec.input.storage_options)
    rows = []
    for shard in plan_shards(storage, list_inputs(storage, spec.input.format), n):
        for row in read_shard(storage, shard):
            if row.error is None:
                own = row.get(spec.input.id_column) if spec.input.id_column else None
                rows.append(row if own is None else replace(row, id=str(own)))
        if len(rows) >= n:
            break
    return rows[:n]


def measure(spec: JobSpec, setting: Setting, rows: list[Row]) -> Measurement:
    """Runs the sample through a fresh engine at `setting`, after a short warm-up. A sample that
    runs in under MIN_SECONDS is run again (up to REPEATS times) and the median run is kept."""
    from engine import SamplingParams
    from pipeline.tasks import start_engine

    spec = spec.model_copy(update={"engine": spec.engine.model_copy(update=setting.__dict__)})
    llm, tasks = start_engine(spec.stage(), spec.workers)  # as a job's actor has it: on CPU, its share of the cores' threads
    refusal = None if tasks.by_choices else llm.refusal("step")  # first-token times need rows watched pass by pass
    if refusal is not None:
        llm.close()
        raise ValueError(f"batchinfer tune: {refusal}")
    try:
        llm.generate(["warm-up"], SamplingParams(max_tokens=2))  # first-call allocations
        runs = []
        with _MemoryPeak() as memory:
            while not runs or (len(runs) < REPEATS and sum(r.seconds for r in runs) < MIN_SECONDS):
                runs.append(_run_once(setting, llm, tasks, rows))
    finally:
        llm.close()  # the next setting's engine starts its own ranks
    run = sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]
    run.memory = llm.facts().memory
    run.kv_bytes_per_token = run.memory["kv_bytes"] // run.memory["kv_tokens"]
    run.peak_memory_bytes = memory.peak
    return run


def _run_once(setting: Setting, llm, tasks, rows) -> Measurement:
    """One pass over the sample."""
    llm.batch_stats.clear()
    start = time.perf_counter()
    counts, ttft = _score(tasks, rows) if tasks.by_choices else _generate(llm, tasks, rows, start)
    seconds = time.perf_counter() - start
    slots = max((s.reserved_tokens for s in llm.batch_stats), default=None)
    return Measurement(setting, seconds, rows=len(rows), **counts, ttft=ttft, peak_kv_tokens=slots)


def _generate(llm, tasks, rows, start: float) -> tuple[dict, list[float]]:
    """The job's prompts and sampling, submitted one request each so that every request's first
    token time can be read."""
    seqs = [llm.add_request(r.prompt, r.params) for r in tasks.requests(rows)]
    while llm.has_unfinished():
        llm.step()
    done = [s.to_completion() for s in seqs]
    counts = {"errors": len(rows) - len(done) + sum(c.finish_reason == "error" for c in done),
              "prompt_tokens": sum(c.num_prompt_tokens for c in done),
              "generated_tokens": sum(c.num_generated_tokens for c in done)}
    return counts, [s.first_token_time - start for s in seqs if s.first_token_time is not None]


def _score(tasks, rows) -> tuple[dict, list[float]]:
    """Labeling by choice scoring: the job's own task code; no tokens are generated."""
    results = tasks.run(rows)
    return {"errors": sum(r.finish_reason == "error" for r in results), "generated_tokens": 0,
            "prompt_tokens": sum(r.num_prompt_tokens for r in results)}, []


class _MemoryPeak:
    """Peak memory while the block runs: CUDA's peak allocation, else this process's resident
    set sampled every 10 ms (Linux /proc; elsewhere the process's lifetime peak)."""

    def __enter__(self):
        import torch

        self.cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.peak, self._stop = _rss(), threading.Event()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        import torch

        self._stop.set()
        if self.cuda:
            self.peak = torch.cuda.max_memory_allocated()
        else:
            self._thread.join()
            self.peak = max(self.peak, _rss())


def _rss() -> int:
    import os
    import resource

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def recommend(results: list[Measurement], memory_limit: int | None) -> Measurement | None:
    """Among the settings with the fewest errors whose peak memory fits under the limit, the
    smallest (least KV memory, then the smallest budget) within NEAR_BEST of the fastest: a bigger
    budget that buys less than that is not worth its memory."""
    if not results:
        return None
    fewest = min(r.errors for r in results)
    fits = [r for r in results if r.errors == fewest and (memory_limit is None or r.peak_memory_bytes <= memory_limit)]
    if not fits:
        return None
    best = max(r.rate for r in fits)
    near = [r for r in fits if r.rate >= (1 - NEAR_BEST) * best]
    return min(near, key=lambda r: (r.peak_kv_bytes or 0, r.setting.max_batch_tokens, r.setting.max_num_seqs, -r.rate))


def run_tune(spec: JobSpec, rows: int, settings: list[Setting], progress=print) -> list[Measurement]:
    """Measures every setting on the first `rows` rows of the job's input."""
    sample = sample_rows(spec, rows)
    if not sample:
        raise ValueError(f"no readable rows in {spec.input.path}")
    results = []
    for i, setting in enumerate(settings, 1):
        progress(f"[{i}/{len(settings)}] {setting.flags()} on {len(sample)} rows")
        results.append(measure(spec, setting, sample))
        gc.collect()  # the setting's engine, before the next one is measured
    return results


def parse_bytes(text: str) -> int:
    """'8GiB', '8G' (10^9), '512MiB', '2e9' -> bytes."""
    units = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
             "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
    raw = text.strip().lower().removesuffix("b")
    number = raw.rstrip("kmgti")
    unit = raw[len(number):]
    if unit not in units or not number:
        raise ValueError(f"not a memory size: {text!r} (e.g. 8GiB, 512MiB, 16G)")
    return int(float(number) * units[unit])
