"""The CUDA check, one command, in stages ordered by how much a failure tells: the engine's
self-check and CPU parity first, then the kernels and the GPU tests, then the default suite's
engine tests on the GPU, then a benchmark. Run it through scripts/gpu_check.sh.

Written for a GPU machine with Python 3.12, torch 2.11 and transformers 5.17 (newer transformers
as a carried .whl), without Ray, xgrammar, jsonschema or pydantic and without network: the
engine runs without Ray, a test file that needs a missing package is skipped in one line, and
everything lands in $OUT as one JSON summary (gpu_check.json), one log (gpu_check.log) and
each stage's figures (STAGE.json where the stage writes them).

    scripts/gpu_check.sh                 # every default stage, bounded at 8 minutes in all
    scripts/gpu_check.sh --from kernels  # a rerun that skips the stages that passed
    scripts/gpu_check.sh --only bench_quant,bench_8b,bench_vlm   # the stages not run by default
    scripts/gpu_check.sh --dry-run       # the stages, their bounds and what each runs (no CUDA)

Each stage's bound is twice its estimate; a stage past its bound is cut and marks the check failed.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOTAL_BOUND_S = 480
"""The default stages' bounds together, machine start excluded: 8 minutes."""


@dataclass(frozen=True)
class Stage:
    name: str
    estimate_s: int
    """What the stage should take on one H100/H200 (the bound is twice this)."""
    command: tuple[str, ...]
    """argv; {out} is $OUT."""
    covers: tuple[str, ...]
    """The engine modules with CUDA-only code this stage exercises (tests/test_gpu_check.py holds
    that every such module is covered by some default stage)."""
    what: str
    requires: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Test file -> packages it imports: skipped, in one line, where one is missing."""
    default: bool = True

    @property
    def bound_s(self) -> int:
        return 2 * self.estimate_s


PYTEST = ("python3", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=")
ENGINE_ON_CUDA = ("tests/engine/test_prefix_cache.py", "tests/engine/test_prompt_logprobs.py",
                  "tests/engine/test_token_options.py", "tests/engine/test_requests.py",
                  "tests/engine/test_structured_outputs.py", "tests/engine/test_pooling.py",
                  "tests/engine/test_lora.py", "tests/engine/test_packed_checkpoints.py")
"""The default suite's engine tests run again on the GPU in float32 (--engine-device cuda): the
prefix cache, prompt logprobs, logit bias / bad words / allowed tokens (their index copies),
structured outputs (xgrammar's bitmask on the device), encoder and decoder pooling, LoRA rows
(index_add_, the graph bypass), GPTQ / AWQ / compressed-tensors checkpoints."""

STAGES = (
    Stage("first_contact", 30, ("python3", "scripts/gpu_first_contact.py", "--json", "{out}/first_contact.json"),
          ("engine/llm_engine.py", "engine/runner/model_runner.py", "engine/runner/devices.py",
           "engine/runner/memory.py", "engine/runner/attention.py", "engine/runner/kernels/triton_attention.py",
           "engine/runner/cuda_graph.py", "engine/quantization/methods.py", "engine/quantization/int4.py",
           "engine/models/files.py", "engine/api/config.py"),
          "16 prompts on builtin:tiny through LLMEngine, CUDA float32 against CPU float32 (greedy tokens "
          "equal); each fast path's self-check under strict_kernels: Triton decode and prefill, one graph "
          "replay against eager, the int8 / int4 / fp8 GEMMs on a model with Q/K/V biases; check and "
          "first-compilation seconds apart"),
    Stage("kernels", 50, (*PYTEST, "tests/engine/test_triton_attention.py"),
          ("engine/runner/kernels/triton_attention.py",),
          "the Triton attention kernels against the torch references at every variant, compiled"),
    Stage("gpu_tests", 80, (*PYTEST, "-s", "-m", "gpu", "tests/engine/test_gpu.py"),
          ("engine/runner/cuda_graph.py", "engine/quantization/methods.py", "engine/quantization/int4.py",
           "engine/distributed/ranks.py"),
          "fp32 parity with transformers with CUDA graphs on, graphs == eager (every bucket as rows drain), "
          "bf16 agreement, int8 / int4 / fp8 (with a bias) near bf16 within their load bounds, NCCL tensor "
          "parallelism where two GPUs are seen"),
    Stage("engine_on_cuda", 50, (*PYTEST, "--engine-device", "cuda", *ENGINE_ON_CUDA),
          ("engine/sample/token_options.py", "engine/runner/attention.py", "engine/runner/model_runner.py",
           "engine/encoder_engine.py"),
          "the default suite's engine tests above on the GPU in float32 (" + ", ".join(
              Path(f).stem.removeprefix("test_") for f in ENGINE_ON_CUDA) + ")",
          requires={"tests/engine/test_structured_outputs.py": ("jsonschema", "xgrammar"),
                    "tests/engine/test_lora.py": ("peft",), "tests/engine/test_pooling.py": ("sentence_transformers",)}),
    Stage("bench", 30, ("python3", "scripts/bench_gpu.py", "--quick", "--skip-eager", "--json", "{out}/bench.json"),
          ("engine/runner/cuda_graph.py",),
          "the 1.2B throughput table (128 requests) and a decode profile"),
    Stage("bench_quant", 40, ("python3", "scripts/bench_gpu.py", "--quick", "--quantization", "int8,int4,fp8",
                              "--json", "{out}/bench_quant.json"), (),
          "the 1.2B workload quantized: bf16 vs int8 vs int4 vs fp8 tok/s and load peaks", default=False),
    Stage("bench_8b", 105, ("python3", "scripts/bench_gpu.py", "--workload", "8b", "--json", "{out}/bench_8b.json",
                           "--model-dir", "/tmp/bench_gpu_8b"), (),
          "the 8B workload: the engine against the limit it computes", default=False),
    Stage("bench_vlm", 60, ("python3", "scripts/bench_vlm.py", "--device", "cuda", "--dtype", "bfloat16",
                            "--json", "{out}/bench_vlm.json"), (),
          "images: the Qwen2.5-VL-shaped bench in bf16, the engine against transformers' batched generate",
          default=False),
)


def selected(args) -> list[Stage]:
    names = [s.name for s in STAGES]
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            raise SystemExit(f"--only: no stage {', '.join(unknown)} (stages: {', '.join(names)})")
        return [s for s in STAGES if s.name in wanted]
    stages = [s for s in STAGES if s.default]
    if args.from_stage:
        if args.from_stage not in [s.name for s in stages]:
            raise SystemExit(f"--from: no default stage {args.from_stage} (stages: {', '.join(s.name for s in stages)})")
        stages = stages[[s.name for s in stages].index(args.from_stage):]
    return stages


def command(stage: Stage, out: Path) -> tuple[list[str], list[str]]:
    """(argv, one line per test file skipped for a missing package)."""
    skipped, argv = [], []
    for part in stage.command:
        missing = [p for p in stage.requires.get(part, ()) if importlib.util.find_spec(p) is None]
        if missing:
            skipped.append(f"skipped {part}: it needs {', '.join(missing)}, which this machine lacks")
            continue
        argv.append(part.replace("{out}", str(out)))
    return argv, skipped


def dry_run(stages: list[Stage]) -> str:
    lines = [f"{'stage':<16} {'bound':>6}  what it runs"]
    for s in stages:
        lines.append(f"{s.name:<16} {s.bound_s:>5}s  {s.what}")
        lines.append(f"{'':<16} {'':>6}  $ {' '.join(s.command)}")
        if s.covers:
            lines.append(f"{'':<16} {'':>6}  covers {', '.join(s.covers)}")
    total = sum(s.bound_s for s in stages)
    lines.append(f"{len(stages)} stages, bounded at {total} s in all")
    return "\n".join(lines)


def run_bounded(argv: list[str], env: dict, bound_s: float, log) -> int | str:
    """Runs argv, its output printed and logged as it comes; its exit status, or "timeout" when it
    was killed (with everything it started) at `bound_s`."""
    try:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
    except OSError as exc:
        return f"could not start: {exc}"

    def pump():
        for line in proc.stdout:
            print(line, end="", flush=True)
            log.write(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=bound_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = "timeout"
    reader.join(timeout=5)
    return rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the stages, their bounds and commands")
    parser.add_argument("--from", dest="from_stage", help="start at this stage (a rerun skips those that passed)")
    parser.add_argument("--only", help="comma-separated stages to run (the non-default ones included)")
    args = parser.parse_args(argv)
    stages = selected(args)
    if args.dry_run:
        print(dry_run(stages))
        return 0
    out = Path(os.environ.get("OUT") or ROOT / "results" / "gpu_check")
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / "gpu_check.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {"stages": {}}
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    failed = False
    with open(out / "gpu_check.log", "a") as log:
        for stage in stages:
            argv_, skipped = command(stage, out)
            header = f"== {stage.name} (bound {stage.bound_s}s): {' '.join(argv_)}"
            print(header, flush=True)
            log.write(header + "\n")
            for line in skipped:
                print(line, flush=True)
                log.write(line + "\n")
            started = time.monotonic()
            rc = run_bounded(argv_, env, stage.bound_s, log)
            seconds = round(time.monotonic() - started, 1)
            status = "passed" if rc == 0 else ("cut at its bound" if rc == "timeout" else f"failed ({rc})")
            failed |= rc != 0
            summary["stages"][stage.name] = {"status": status, "seconds": seconds, "bound_s": stage.bound_s,
                                             "skipped": skipped}
            summary_path.write_text(json.dumps(summary, indent=2))
            line = f"== {stage.name}: {status} in {seconds}s"
            print(line, flush=True)
            log.write(line + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
