"""Pure modules import without torch or transformers (a job spec can be read on any machine)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

BLOCKER = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError(f"{name} is blocked in this test")
sys.meta_path.insert(0, Block())
import engine, engine.config, engine.errors, engine.sampling_params, engine.scheduler, engine.sequence, jobs.spec
assert "torch" not in sys.modules and "transformers" not in sys.modules
print("ok")
"""


def test_config_sampling_scheduler_and_spec_import_without_torch():
    out = subprocess.run([sys.executable, "-c", BLOCKER], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_engine_class_is_still_importable_from_the_package():
    out = subprocess.run([sys.executable, "-c", "from engine import LLMEngine; print(LLMEngine.__name__)"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "LLMEngine", out.stderr[-2000:]


NO_TRITON = """
import sys, types
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "triton":
            raise ImportError(f"{name} is blocked in this test")
sys.meta_path.insert(0, Block())
from engine import LLMEngine, attention
cuda_tensor = types.SimpleNamespace(device=types.SimpleNamespace(type="cuda"))
assert attention._triton_kernels(cuda_tensor) is None  # CUDA falls back to the torch paths
assert "triton" not in sys.modules
print("ok")
"""


def test_the_engine_needs_no_triton():
    out = subprocess.run([sys.executable, "-c", NO_TRITON], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
