"""The `batchinfer` command line. Exit codes: jobs/exit_codes.py."""
from __future__ import annotations

import json
import sys

import click

from engine import __version__
from jobs.exit_codes import EXIT_ERROR_RATE, EXIT_FAILED, EXIT_OK, EXIT_USAGE
from jobs.spec import JobSpec, SpecError, field_reference, load_spec
from jobs.terminal import QuietTerminal, terminal
from jobs.tune import DEFAULT_ROWS

_verbose = click.option("--verbose", is_flag=True,
                        help="Show everything Ray and the libraries print (by default it goes to a log file, "
                             "named when the command fails).")


def _spec_options(fn):
    fn = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                      help="Override any spec field, e.g. --set engine.max_batch_tokens=4096 (repeatable).")(fn)
    fn = click.option("--output", help="Output directory (sets output.path).")(fn)
    fn = click.option("--input", "input_", help="Input file, directory or glob (sets input.path).")(fn)
    fn = click.option("--model", help="Model directory or builtin:NAME (sets model).")(fn)
    fn = click.argument("config", required=False, type=click.Path(dir_okay=False))(fn)
    return fn


def _load(config, model, input_, output, overrides) -> JobSpec:
    try:
        return load_spec(config, list(overrides), model=model, input=input_, output=output)
    except SpecError as exc:
        click.echo(f"error: {exc}", file=terminal())
        sys.exit(EXIT_USAGE)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="batchinfer")
def main() -> None:
    """Offline batch inference for large language models.

    Every spec field is listed by `batchinfer spec`."""


@main.command()
@_spec_options
@click.option("--overwrite", is_flag=True, help="Delete what the output path holds and start afresh.")
@click.option("--address", default=None, help="Ray cluster address (auto, ray://host:10001); default: start a local Ray.")
@_verbose
def run(config, model, input_, output, overrides, overwrite, address, verbose):
    """Run (or resume) the job in CONFIG, or over --input with the defaults.

    A rerun of the same spec on the same output resumes: committed shards are skipped."""
    spec = _load(config, model, input_, output, overrides)
    with QuietTerminal(verbose, click.get_text_stream("stderr")) as quiet:
        code = execute(spec, overwrite=overwrite, address=address, verbose=verbose)
        _failed(quiet, code)
    sys.exit(code)


def _failed(quiet: QuietTerminal, code: int) -> None:
    """After a command that failed: where the output it kept off the terminal is, if it kept any."""
    if code != EXIT_OK and quiet.logged():
        quiet.keep = True
        click.echo(f"(the log of Ray and the libraries: {quiet.path})", file=terminal())


def execute(spec: JobSpec, overwrite: bool = False, address: str | None = None, verbose: bool = True) -> int:
    """Runs a validated spec; prints the summary; returns the exit code. Not `verbose`: the Ray
    this starts keeps its workers' output in its session logs."""
    from pipeline.errors import JobError
    from pipeline.io import scrub, secret_values
    from pipeline.run import run_job
    from pipeline.spec import Job

    secrets = secret_values(spec.input.storage_options, spec.output.storage_options)
    try:
        result = run_job(Job.of(spec), overwrite=overwrite, address=address, progress=_progress(secrets),
                         log_to_driver=verbose)
    except JobError as exc:
        click.echo(f"error: {scrub(str(exc), secrets)}", file=terminal())
        return EXIT_FAILED
    if result.status == "nothing_to_do":
        click.echo(f"nothing to do: {result.output} is already complete ({result.rows} rows); "
                   "use --overwrite to run again")
        return EXIT_OK
    click.echo(summary_table(result))
    if result.status == "error_rate_exceeded":
        rate = result.errors / result.rows
        click.echo(f"error: {result.errors} of {result.rows} rows failed ({rate:.2%} > max_error_rate "
                   f"{spec.max_error_rate}); first causes:", file=terminal())
        for cause in result.error_samples[:5]:
            click.echo(f"  - {scrub(cause, secrets)}", file=terminal())
        return EXIT_ERROR_RATE
    return EXIT_OK


def _progress(secrets):
    """A live bar when stderr is a terminal, plain lines otherwise (logs, cron, ray job submit)."""
    from pipeline.io import scrub
    from pipeline.run import Progress, ProgressBar

    stream = terminal()
    write = lambda msg: click.echo(scrub(msg, secrets), file=stream)  # noqa: E731
    return ProgressBar(stream, write) if stream.isatty() else Progress(write)


def summary_table(result) -> str:
    manifest = result.manifest
    run = manifest.this_run
    rows = [("output", result.output), ("rows", f"{result.rows} ({result.rows_this_run} this run)"),
            ("errors", str(result.errors)), ("prompt tokens", str(result.prompt_tokens)),
            ("prefix cache hits", f"{manifest.prefix_cache_hit_rate:.1%} of prompt tokens"),
            ("generated tokens", str(result.generated_tokens)),
            ("wall time", f"{result.seconds:.1f}s ({result.generate_seconds:.1f}s generating)"),
            ("tokens/s", f"{run.get('generated_tokens_per_second', 0.0):.1f} (this run)")]
    for name, m in (manifest.metrics or {}).items():  # pass@k and maj@n: "<metric> pass@k"
        if m["mean"] is not None:
            ci = f"95% CI {m['ci95'][0]:.4f}-{m['ci95'][1]:.4f}, " if m["ci95"] else ""
            rows.append((name, f"{m['mean']:.4f} ({ci}n={m['count']})"))
    batch = manifest.openai_batch
    if batch:
        counts = batch["request_counts"]
        rows.append(("openai batch", f"{counts['completed']} completed, {counts['failed']} failed -> "
                                     f"{batch['output_file']}, {batch['error_file']}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


@main.command()
@_spec_options
@_verbose
def validate(config, model, input_, output, overrides, verbose):
    """Check a spec, its inputs and its model as `run` does before it starts, and count rows; no generation."""
    from pipeline.errors import InputError, JobError
    from pipeline.io import Storage
    from pipeline.run import check_adapters, job_shards, listed_adapters, output_plan, preflight

    spec = _load(config, model, input_, output, overrides)
    with QuietTerminal(verbose, click.get_text_stream("stderr")) as quiet:
        try:
            spec = listed_adapters(spec)
            files = preflight(spec, click.echo)
            check_adapters(spec)
            storage = Storage(spec.input.path, spec.input.storage_options)
            rows = shards = 0
            for shard in job_shards(spec, files, output_plan(spec)):  # the shards `run` would cut
                rows += shard.stop - shard.start
                shards += 1
        except (JobError, InputError) as exc:
            click.echo(f"error: {exc}", file=terminal())
            _failed(quiet, EXIT_FAILED)
            sys.exit(EXIT_FAILED)
    for path, name, fmt in files[:20]:
        click.echo(f"  {fmt:8} {storage.uri(path)}")
    if len(files) > 20:
        click.echo(f"  ... and {len(files) - 20} more")
    click.echo(f"ok: {len(files)} files, {rows} rows (JSONL: lines), {shards} shards; model {spec.model}")


@main.command()
@click.argument("output")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--storage-option", "options", multiple=True, metavar="KEY=VALUE",
              help="fsspec option for the output filesystem (repeatable).")
def report(output, as_json, options):
    """Summarise a finished or partial job from what its OUTPUT directory holds."""
    from pipeline.run import output_report

    try:
        data = output_report(output, dict(o.split("=", 1) for o in options))
    except FileNotFoundError as exc:
        click.echo(f"error: {exc}", file=terminal())
        sys.exit(EXIT_FAILED)
    if as_json:
        click.echo(json.dumps(data, indent=1, default=str))
        return
    click.echo(report_table(data))


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def report_table(data: dict) -> str:
    usage = data.get("usage", {})
    rows = [("output", data["output"]), ("status", data["status"]),
            ("shards committed", f"{data['shards_committed']}"
             + (f" of {data['shards_planned']}" if data.get("shards_planned") else "")),
            ("rows", str(data["rows"])), ("errors", str(data["errors"])),
            ("prompt tokens", str(data["prompt_tokens"])), ("generated tokens", str(data["generated_tokens"])),
            ("prefix cache hits", f"{data.get('cached_prompt_tokens', 0) / max(data['prompt_tokens'], 1):.1%} "
                                  "of prompt tokens"),
            ("runs", str(usage.get("runs", 0))),
            ("generating time", f"{usage.get('generate_seconds', 0.0):.1f}s"),
            ("tokens/s", f"{usage.get('tokens_per_second', 0.0):.1f}")]
    rows += [(k.replace("_", " "), f"{v:.4f}") for k, v in usage.items() if k.endswith("_hours")]
    if "cost" in usage:
        per_m = usage.get("cost_per_1m_generated_tokens")
        rows += [("cost", f"{usage['cost']:.4f}"),
                 ("cost per 1M generated tokens", f"{per_m:.4f}" if per_m is not None else "-")]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    workers = data.get("workers", {})
    if workers:
        lines.append("")
        lines.append(f"{'worker'.ljust(24)} {'shards':>7} {'rows':>9} {'tokens':>10} {'busy s':>9} {'tok/s':>8}")
        for name, w in sorted(workers.items()):
            lines.append(f"{name[:24].ljust(24)} {w['shards']:>7} {w['rows']:>9} {w['generated_tokens']:>10} "
                         f"{w['seconds']:>9.1f} {w['tokens_per_second']:>8.1f}")
    engines = data.get("engines", [])
    if engines:  # what each engine resolved to and held: device, dtype, method, weights, KV pool
        lines += ["", f"{'engine':<24} {'quantization':>12} {'weights':>10} {'KV blocks':>9} {'KV pool':>10} "
                      f"{'batched':>8} {'shards':>7}"]
        for e in engines:
            tp = f" x{e['tensor_parallel_size']}" if (e.get("tensor_parallel_size") or 1) > 1 else ""
            lines.append(f"{(e['device'] + ' ' + e['dtype'] + tp)[:24]:<24} {e.get('quantization') or '-':>12} "
                         f"{_mib(e.get('weights_bytes')):>10} {e.get('kv_blocks') or 0:>9} {_mib(e.get('kv_bytes')):>10} "
                         f"{e.get('max_num_batched_tokens') or '-':>8} {e['shards']:>7}")
            if e.get("rank_load_peak_bytes"):  # tensor parallelism: what each rank held and loaded
                lines.append(f"{'':<24} ranks' weights {' / '.join(map(_mib, e['rank_weights_bytes']))}, "
                             f"load peaks {' / '.join(map(_mib, e['rank_load_peak_bytes']))}")
            for path, state in (e.get("fast_paths") or {}).items():  # engine.runner.fast_paths' checks
                lines.append(f"{'':<24} {path}: {state}")
    adapters = data.get("adapters", {})
    if adapters:  # metrics.json's per-adapter figures: one table compares the fine-tunes
        metrics = [m for m in next(iter(adapters.values())) if m != "rows"]
        lines += ["", f"{'adapter'.ljust(24)} {'rows':>9} " + " ".join(f"{m[:14]:>14}" for m in metrics)]
        for name, a in sorted(adapters.items(), key=lambda kv: (kv[0] != "null", kv[0])):  # the base first
            shown = "(base model)" if name == "null" else name[:24]
            lines.append(f"{shown.ljust(24)} {a['rows']:>9} " + " ".join(
                f"{a[m]:>14.4f}" if isinstance(a[m], (int, float)) else f"{'-':>14}" for m in metrics))
    return "\n".join(lines)


@main.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--model", help="Model directory, Hugging Face id or builtin:NAME (sets model).")
@click.option("--input", "input_", help="Input file, directory or glob (sets input.path).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override any spec field (repeatable).")
@click.option("--rows", type=click.IntRange(min=1), default=DEFAULT_ROWS, show_default=True,
              help="Rows of the job's input to run at each setting.")
@click.option("--memory-limit", default=None, metavar="SIZE",
              help="Recommend only settings whose peak memory fits, e.g. 8GiB (GPU memory on CUDA).")
@click.option("--max-batch-tokens", "mbt", default=None, metavar="N,N,...",
              help="max_batch_tokens values [default: 1 and 2 x the spec's].")
@click.option("--max-num-seqs", "mns", default=None, metavar="N,N,...",
              help="max_num_seqs values [default: 1/4 and 1 x the spec's].")
@click.option("--scheduling", default=",".join(("static", "continuous")), show_default=True, metavar="MODE,...")
@click.option("--plot", is_flag=False, flag_value="tune.png", default=None, metavar="[PNG]",
              help="Also draw throughput against peak memory (default file tune.png; needs matplotlib).")
@_verbose
def tune(config, model, input_, overrides, rows, memory_limit, mbt, mns, scheduling, plot, verbose):
    """Measure batching settings on a sample of the job's input and recommend one.

    Runs the sample at each max_batch_tokens x max_num_seqs x scheduling point in this process
    and prints throughput, time to first token, peak KV-cache and peak memory per setting."""
    from jobs import tune as T
    from jobs import tune_report as R

    spec = _load(config, model, input_, "(unused by tune)", overrides)
    with QuietTerminal(verbose, click.get_text_stream("stderr")) as quiet:
        try:
            limit = T.parse_bytes(memory_limit) if memory_limit else None
            settings = T.make_grid(spec, _ints(mbt) if mbt else None, _ints(mns) if mns else None,
                                   [m.strip() for m in scheduling.split(",") if m.strip()])
            results = T.run_tune(spec, rows, settings, progress=lambda m: click.echo(m, file=terminal()))
        except (ValueError, RuntimeError) as exc:
            click.echo(f"error: {exc}", file=terminal())
            code = EXIT_USAGE if isinstance(exc, ValueError) else EXIT_FAILED
            _failed(quiet, code)
            sys.exit(code)
    best = T.recommend(results, limit)
    click.echo(R.table(results, best))
    click.echo(R.pools(results))
    click.echo(R.summary(results, best, limit))
    if plot:
        try:
            R.plot(results, best, limit, plot)
        except RuntimeError as exc:
            click.echo(f"error: {exc}", file=terminal())
            sys.exit(EXIT_FAILED)
        click.echo(f"plot: {plot}")


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"expected positive integers, got {text!r}")
    return values


@main.command(name="spec")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def spec_cmd(as_json):
    """List every job spec field with its type, default and description."""
    rows = field_reference()
    if as_json:
        click.echo(json.dumps([dict(zip(("key", "type", "default", "description"), r)) for r in rows], indent=1))
        return
    width = max(len(r[0]) for r in rows)
    for key, typ, default, desc in rows:
        click.echo(f"{key.ljust(width)}  {desc} [{typ}; default {default}]")


if __name__ == "__main__":
    main()
