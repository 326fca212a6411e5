"""scripts/gpu_check.py, the one command a GPU machine runs, held on a CPU: its stages, their
bounds and what they cover, without CUDA (--dry-run); its bounded runner; and its first stage's
script, run here against the CPU."""
from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402

CUDA_CODE = re.compile(r"torch\.cuda\.|\.is_cuda\b|[\"']cuda[\"']|import triton|_scaled_mm|_int_mm|_weight_int4pack_mm\(")


def cuda_modules() -> list[str]:
    """The engine's modules with code that runs only on CUDA."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "engine").rglob("*.py")
                  if CUDA_CODE.search(p.read_text()))


def test_every_module_with_cuda_code_is_covered_by_a_default_stage():
    covered = {m for s in gpu_check.STAGES if s.default for m in s.covers}
    missing = [m for m in cuda_modules() if m not in covered]
    assert not missing, f"CUDA code no stage of scripts/gpu_check.py exercises (add it to a stage's covers): {missing}"
    assert all((ROOT / m).exists() for m in covered)
    assert len(cuda_modules()) >= 10  # the scan finds what it is meant to


def test_the_dry_run_prints_the_stages_bounds_and_commands_within_eight_minutes():
    out = subprocess.run([sys.executable, "scripts/gpu_check.py", "--dry-run"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    defaults = [s for s in gpu_check.STAGES if s.default]
    assert [s.name for s in defaults][0] == "first_contact" and defaults[0].bound_s <= 60
    for s in defaults:
        assert re.search(rf"^{s.name}\s+{s.bound_s}s ", out.stdout, re.M), s.name
        assert s.bound_s == 2 * s.estimate_s
    assert sum(s.bound_s for s in defaults) <= gpu_check.TOTAL_BOUND_S
    assert f"bounded at {sum(s.bound_s for s in defaults)} s in all" in out.stdout
    assert "tests/engine/test_triton_attention.py" in out.stdout and "--engine-device cuda" in out.stdout
    for test_file in gpu_check.ENGINE_ON_CUDA:
        assert (ROOT / test_file).exists()


def test_from_and_only_choose_stages():
    parse = gpu_check.argparse.Namespace
    names = [s.name for s in gpu_check.selected(parse(only=None, from_stage="gpu_tests"))]
    assert names[0] == "gpu_tests" and "first_contact" not in names and "bench_8b" not in names
    assert [s.name for s in gpu_check.selected(parse(only="bench_8b", from_stage=None))] == ["bench_8b"]
    with pytest.raises(SystemExit, match="no stage nope"):
        gpu_check.selected(parse(only="nope", from_stage=None))


def test_a_stage_past_its_bound_is_cut_with_what_it_started():
    log = io.StringIO()
    rc = gpu_check.run_bounded(["bash", "-c", "echo started; sleep 60 & wait"], {}, 1.0, log)
    assert rc == "timeout" and "started" in log.getvalue()
    assert gpu_check.run_bounded(["bash", "-c", "exit 3"], {}, 10, io.StringIO()) == 3


def test_a_test_file_whose_package_is_missing_is_skipped_in_one_line():
    stage = gpu_check.Stage("x", 1, ("pytest", "a.py", "b.py"), (), "", requires={"a.py": ("os", "no_such_package_here")})
    argv, skipped = gpu_check.command(stage, Path("/tmp"))
    assert argv == ["pytest", "b.py"] and skipped == ["skipped a.py: it needs no_such_package_here, which this "
                                                      "machine lacks"]


def test_the_first_stage_runs_against_the_cpu(tmp_path):
    """The script a GPU's first contact runs, here on the CPU against itself: it must not be
    the GPU machine that finds an error in it."""
    out = subprocess.run([sys.executable, "scripts/gpu_first_contact.py", "--device", "cpu", "--json",
                          str(tmp_path / "fc.json")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    report = json.loads((tmp_path / "fc.json").read_text())
    assert report["failures"] == [] and report["tiny_float32_same_as_cpu"] == "16/16"
    assert report["engines"]["qwen2 int8"]["fast_paths"]["int8_gemm"] == "checked"
