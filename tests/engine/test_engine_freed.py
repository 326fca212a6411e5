"""An engine dropped by its last reference is gone at once: nothing below it holds it (no Pooler,
scorer or profiler takes the engine: they take engine.core.paged.PagedPass), and no import made
while it was built keeps its constructor's frame. The kinds run in a fresh process with the cyclic
collector off, one after another (the first engine of a process, whose build imports torch's
and the model's code, is checked too), and a tensor-parallel engine in one of its own, after
which a second one starts."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.models.builtin import builtin_path
from lora_models import make_adapter
from pooling_models import build_decoder_embedder, build_encoder

SCRIPT = """
import gc, sys, weakref
gc.disable()
from engine import EngineConfig, LLMEngine, LoRARequest, SamplingParams
greedy = SamplingParams(max_tokens=3, temperature=0)

def build(kind, path):
    if kind == "plain":
        llm = LLMEngine(EngineConfig(model="builtin:tiny"))
        llm.generate(["hello"], greedy)
        llm.score_choices(["pick:"], [[" a", " b"]])
    elif kind == "lora":
        llm = LLMEngine(EngineConfig(model="builtin:tiny", enable_lora=True))
        llm.generate(["hello", "hi"], greedy, lora_request=[LoRARequest("ft", 1, path), None])
    elif kind in ("encoder", "decoder-pooling"):
        llm = LLMEngine(EngineConfig(model=path))
        llm.embed(["a row", "another row"])
    else:
        llm = LLMEngine(EngineConfig(model="builtin:tiny", tensor_parallel_size=2))
        llm.generate(["hello"], greedy)
    return llm

for kind, path in zip(sys.argv[1::2], sys.argv[2::2]):
    llm = build(kind, path)
    alive = weakref.ref(llm)
    del llm
    assert alive() is None, f"the {kind} engine outlived its last reference"
    if kind == "tensor-parallel":
        again = build(kind, path)  # its ranks stopped with the first: a second one starts
        again.close()
    print("freed", kind)
"""


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("freed")
    return {"plain": "-", "tensor-parallel": "-",
            "lora": str(make_adapter(builtin_path("builtin:tiny"), root / "ft", 4, ["q_proj", "v_proj"], seed=1)),
            "encoder": str(build_encoder(root / "bert")),
            "decoder-pooling": str(build_decoder_embedder(root / "qwen3"))}


@pytest.mark.parametrize("kinds", [("plain", "lora", "encoder", "decoder-pooling"), ("tensor-parallel",)],
                         ids=["plain-lora-pooling", "tensor-parallel"])
def test_an_engine_is_freed_when_its_last_reference_goes(kinds, paths):
    args = [x for kind in kinds for x in (kind, paths[kind])]
    done = subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stdout.split() == [w for kind in kinds for w in ("freed", kind)], done.stdout
