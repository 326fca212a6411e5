"""Whether an output accepts a job, and what its JobRecord learns: one place for what a rerun checks
against `_job.json` (the spec's fingerprint, the numerics it computes in, its adapters, its model
and input files). The record is read (earlier versions' shapes included) and changed by its owner,
pipeline.io.OutputDir."""
from __future__ import annotations

import time
from importlib.metadata import PackageNotFoundError, version

from engine.api import one_line
from pipeline.errors import JobError, OutputConflict
from pipeline.io import ROWS_PLAN, JobRecord, OutputDir, redact_spec
from pipeline.run.checks.adapters import adapters_conflict
from pipeline.run.checks.inputs import input_conflict
from pipeline.run.shards.devices import picks_devices, resolve_devices
from pipeline.run.shards.planner import new_plan_record
from pipeline.spec import Job, resumes


def claim(out: OutputDir, job: Job, overwrite: bool, adapters: dict[str, str], model: dict | None = None,
          inputs: dict | None = None) -> JobRecord:
    """The output's record for `job`: a fresh output's, saved now, or the existing one when it
    accepts the job (OutputConflict naming why not), brought up to date: a fingerprint that only
    differs in what stopped counting is re-recorded, adapters are recorded (an added one reopens a
    complete output: its rows are still to compute), and so are the model's identity `model`
    (pipeline.run.checks.model) where the record has none, and the input files `inputs`
    (pipeline.run.checks.inputs) where they are new or only added to."""
    try:
        if overwrite:
            out.clear()
        record = out.open_record() or out.start_record(_start(job, model, inputs))
    except (OSError, PermissionError, ValueError) as exc:
        raise JobError(f"cannot write to output {job.spec.output.path}: {one_line(exc)}") from None
    # a complete output takes no more rows: its model and input files are not checked
    complete = out.is_complete()
    refused = refusal(record, job, out, adapters) or (None if complete else (
        model_conflict(job, record.model_identity, model)
        or (input_conflict(job.spec.output.path, record.inputs, inputs) if inputs is not None else None)))
    if refused:
        raise OutputConflict(refused)
    learned = {}
    if model is not None and record.model_identity is None:  # EARLIER_SHAPES "no model_identity"
        learned["model_identity"] = model
    if inputs is not None and not complete and record.inputs != inputs:  # "no inputs", or files added
        learned["inputs"] = inputs
    if record.fingerprint not in {job.fingerprint, *job.spec.accepted_fingerprints()}:
        # accepted through the spec it recorded: an earlier version counted a setting never found to change a row
        learned["fingerprint"] = job.fingerprint
    if adapters and record.adapters != adapters:
        if record.adapters is not None:
            out.reopen()
        learned["adapters"] = adapters
    return out.change_record(**learned)


def refusal(record: JobRecord, job: Job, out: OutputDir, adapters: dict[str, str]) -> str | None:
    """Why the output of `record` cannot take `job` (None: it can): another spec, other numerics
    (where the spec fixes them: where batchinfer picks the devices, choose_devices checks once it
    has the cluster; a complete output is not checked), or adapters changed or dropped."""
    if record.fingerprint not in {job.fingerprint, *job.spec.accepted_fingerprints()} and not resumes(job.spec, record.spec):
        return _conflict(job, record)
    numerics = job.spec.numerics()
    if numerics_differ(record.numerics, numerics) and not out.is_complete() and not picks_devices(job.spec):
        return _numerics_conflict(job, record.numerics, numerics)
    return adapters_conflict(job.spec.output.path, record.adapters, adapters)


def model_conflict(job: Job, was: dict | None, now: dict | None) -> str | None:
    """Why an output whose rows came from the model `was` cannot resume on `now` (None: it can)."""
    if was is None or now is None or was == now:
        return None
    return (f"{job.spec.output.path}: the model {job.spec.model} changed since its rows were written "
            f"({was.get('id')} then, {now.get('id')} now): write to a new output.path, or use --overwrite to start "
            "afresh")


def numerics_differ(was: dict | None, now: dict) -> bool:
    """Whether an output that computed in `was` (its record's numerics) would compute otherwise in
    `now`, on what `was` says (an earlier output's record may say only its device)."""
    return was is not None and any(now.get(k) != v for k, v in was.items())


def choose_devices(job: Job, out: OutputDir, progress) -> bool:
    """engine.device auto with workers.gpus unset: GPUs where the cluster has them (one per rank).
    A fresh output records the numerics chosen; a resumed one generated on CPU stays on CPU.
    Returns whether batchinfer chose GPUs."""
    resumed, was = out.has_parts(), out.record.numerics
    choice = resolve_devices(job.spec, keep_cpu=resumed and (was or {}).get("device") == "cpu")
    progress(choice.line)
    numerics = job.spec.numerics()
    if choice.resolved and was != numerics:
        if resumed and numerics_differ(was, numerics):
            raise OutputConflict(_numerics_conflict(job, was, numerics))
        out.change_record(numerics=numerics)
    return choice.resolved and choice.gpus > 0


def _start(job: Job, model: dict | None, inputs: dict | None) -> JobRecord:
    spec = job.spec.model_dump(mode="json") | {"fingerprint": job.fingerprint}  # as 0.1 wrote it
    return JobRecord(fingerprint=job.fingerprint, created=time.time(), **new_plan_record(),
                     numerics=job.spec.numerics(), spec=redact_spec(spec), batchinfer_version=_version(),
                     model_identity=model, inputs=inputs)


def _version() -> str | None:
    try:
        return version("batchinfer")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return None


def _conflict(job: Job, record: JobRecord) -> str:
    where = job.spec.output.path
    if record.shard_plan == ROWS_PLAN and job.spec.workers.rows_per_batch is None:
        # shards held rows_per_batch rows (default 256)
        return (f"{where} was started by an earlier batchinfer that cut shards every workers.rows_per_batch rows "
                f"(default 256): resume it with --set workers.rows_per_batch=256, or use --overwrite to start afresh")
    recorded_model = (record.spec or {}).get("model")
    if recorded_model == "builtin:tiny" and "model" not in job.spec.model_fields_set and recorded_model != job.spec.model:
        # builtin:tiny was the default model before builtin:smollm2-135m-instruct
        return (f"{where} was generated by builtin:tiny, the default model of earlier versions (now "
                f"{job.spec.model}): add `model: builtin:tiny` to the spec to resume it, or use --overwrite")
    return (f"{where} holds the output of a different job spec (fingerprint {record.fingerprint} != "
            f"{job.fingerprint}); use --overwrite to replace it")


def _numerics_conflict(job: Job, was: dict, now: dict) -> str:
    def say(n: dict) -> str:
        return f"{n['dtype']} on {n['device']}" if "dtype" in n else n["device"]

    how = ("workers.gpus 0" if was["device"] == "cpu" else "workers.gpus > 0") if job.spec.engine.device == "auto" \
        else f"engine.device {was['device']}"
    return (f"{job.spec.output.path} was generated in {say(was)}, and this run would compute in {say(now)} "
            f"(engine.device {job.spec.engine.device}, engine.dtype {job.spec.engine.dtype}, workers.gpus "
            f"{job.spec.workers.gpus:g}), which gives other rows: resume it with {how}, or use --overwrite to start afresh")
