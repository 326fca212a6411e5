"""Pure modules import without torch or transformers (a job spec can be read on any machine), and
the imports the docs (README.md, CONTRIBUTING.md, docs/*.md) show work."""
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
import engine, engine.api, engine.core, engine.models, jobs.spec
from engine import EngineConfig, SamplingParams, StructuredOutputsParams, ModelLoadError, EchoEngine
assert "torch" not in sys.modules and "transformers" not in sys.modules
print("ok")
"""


def test_the_torch_free_packages_and_the_spec_import_without_torch():
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
from engine import LLMEngine
from engine.runner import attention
cuda_tensor = types.SimpleNamespace(device=types.SimpleNamespace(type="cuda"))
assert attention._triton_kernels(cuda_tensor) is None  # CUDA falls back to the torch paths
assert "triton" not in sys.modules
print("ok")
"""


def test_the_engine_needs_no_triton():
    out = subprocess.run([sys.executable, "-c", NO_TRITON], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


README_IMPORTS = """
from engine import LLMEngine, EngineConfig, SamplingParams
from engine import StructuredOutputsParams
from engine import Completion, Sample, BatchStats, ChoiceScores, EchoEngine, ECHO_MODEL, __version__
from engine import EngineError, ModelLoadError, RankError, one_line
from pipeline import build_processor
import jobs.cli, jobs.run
print("ok")
"""


def test_the_documented_public_imports_work():
    """Every `from engine|pipeline import ...` line of README.md, CONTRIBUTING.md and docs/*.md, and
    the names the engine's face lists."""
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
    starts = ("from engine", "import engine", "from pipeline", "import pipeline")
    documented = sorted({line.strip() for page in pages for line in page.read_text().splitlines()
                         if line.strip().startswith(starts)})
    assert documented, "the docs show no engine or pipeline import"
    script = "\n".join(documented) + README_IMPORTS + "import engine\nfor n in engine.__all__: getattr(engine, n)\n"
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
