"""What a complete job writes last: its final files (metrics.json, OpenAI Batch output files) and
manifest.json, which stays small: counts, usage and a pointer to the part index."""
from __future__ import annotations

import platform
import time

from engine import __version__
from pipeline.io import LAYOUT, IndexWriter, Manifest, OutputDir, RunRecord, entries, redact_spec
from pipeline.run.reporting.metrics import MetricsAccumulator, write_metrics
from pipeline.run.reporting.sample_metrics import SampleMetrics
from pipeline.run.reporting.report import PartTotals, usage
from pipeline.spec import ADAPTER, Job, JobSpec, reports_metrics


def final_files(spec: JobSpec, out: OutputDir, index: Manifest) -> dict:
    """Files computed from the committed parts (so a resumed job writes what an uninterrupted
    one would): metrics.json for task eval; output.jsonl and errors.jsonl for openai_batch.
    `index`: the manifest being written, as far as its part index. Returns the manifest's fields
    for them."""
    extra = {}
    if reports_metrics(spec):
        ev, samples = spec.eval, None
        if spec.sampling.n > 1:
            samples = SampleMetrics(ev.metrics, spec.sampling.n, ev.k, reference_column=ev.reference_column,
                                    group_column=ev.group_column, normalize=ev.normalize.model_dump(),
                                    answer_regex=ev.answer_regex)
        by_adapter = None
        if spec.lora.active:
            by_adapter = MetricsAccumulator(ev.metrics, ADAPTER, SampleMetrics(
                ev.metrics, spec.sampling.n, ev.k, reference_column=ev.reference_column, group_column=ADAPTER,
                normalize=ev.normalize.model_dump(), answer_regex=ev.answer_regex) if spec.sampling.n > 1 else None)
        extra["metrics"] = write_metrics(out, entries(out, index), ev.metrics, ev.group_column, samples,
                                         by_adapter)
    finished = out.finish(entries(out, index))  # the format's own files (openai_batch: output.jsonl, errors.jsonl)
    if finished is not None:
        extra[out.format] = finished
    return extra


def build_manifest(job: Job, out: OutputDir, index: IndexWriter, totals: PartTotals, run: RunRecord) -> Manifest:
    """Counts, usage and pointers; the parts are listed in the index it points to. `run` is this
    run's record; the output's job record gives its creation time."""
    data = totals.result()
    finals = final_files(job.spec, out, Manifest(index=index.pointer()))
    manifest = Manifest(
        batchinfer_version=__version__,
        layout=LAYOUT,
        status="complete",
        spec=redact_spec(job.spec.model_dump(mode="json")),
        fingerprint=job.fingerprint,
        model=job.spec.model,
        format=out.format,
        versions=versions(),
        **data,
        prefix_cache_hit_rate=data["cached_prompt_tokens"] / data["prompt_tokens"] if data["prompt_tokens"] else 0.0,
        usage=usage(out.read_runs(), data["generated_tokens"], job.spec.report.price_per_hour),
        index=index.pointer(),
        planning=run.planning,
        created=out.record.created,
        finished=time.time(),
        this_run=run.counts() | {"run_id": run.run_id, "generate_seconds": run.generate_seconds,
                                    "wall_seconds": run.finished - run.started,
                                    "generated_tokens_per_second": run.generated_tokens / run.generate_seconds
                                    if run.generate_seconds else 0.0},
        **finals)
    if manifest.error_rate > job.spec.max_error_rate:
        manifest.status = "error_rate_exceeded"
    return manifest


def versions() -> dict:
    """Versions of Python and of the libraries that shape the output."""
    import pyarrow
    import torch
    import transformers

    found = {"python": platform.python_version(), "batchinfer": __version__, "torch": torch.__version__,
             "transformers": transformers.__version__, "pyarrow": pyarrow.__version__}
    try:
        import ray

        found["ray"] = ray.__version__
    except ImportError:
        pass
    return found
