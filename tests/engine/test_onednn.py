"""CPU float32 linear layers on oneDNN-reordered weights (engine.runner.onednn): which layers are
packed, that the tokens stay transformers', and that a fast path failing its check is turned off
for that engine in one warning, the tokens unchanged."""
from __future__ import annotations

import shutil
import warnings

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.runner import onednn
from lora_models import greedy

PROMPT = [5, 17, 33, 2, 9, 41]


def run(path) -> tuple[LLMEngine, list[int]]:
    llm = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu"))
    out = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].token_ids
    return llm, out


def test_every_plain_linear_but_the_tied_head_is_packed_and_the_tokens_are_transformers(tiny_model_dir,
                                                                                         reference_model):
    path = tiny_model_dir("llama")
    llm, got = run(path)
    model = llm.runner.model
    layers = model.config.num_hidden_layers
    packed = [n for n, m in model.named_modules() if isinstance(m, onednn.PackedLinear)]
    assert len(packed) == llm.runner.packed_linears == 7 * layers  # q k v o gate up down
    assert not any(isinstance(p, torch.nn.Parameter) for m in model.modules()
                   if isinstance(m, onednn.PackedLinear) for p in [m.weight])
    assert type(model.get_output_embeddings()) is onednn.OneDnnLinear  # the head: its own weight, not a copy
    assert got == greedy(reference_model(path), PROMPT, 8)


def test_float32_only_and_cpu_only():
    layer = torch.nn.Linear(8, 4)
    model = torch.nn.Sequential(layer)
    assert onednn.pack_linears(model, torch.device("cpu"), torch.bfloat16) == 0
    assert onednn.pack_linears(model, torch.device("meta"), torch.float32) == 0
    assert model[0] is layer


def test_a_shared_weight_stays_and_forward_hooks_carry_over():
    shared = torch.nn.Linear(8, 8)
    other = torch.nn.Linear(8, 8)
    other.weight = shared.weight
    hooked = torch.nn.Linear(8, 4)
    calls = []
    handle = hooked.register_forward_hook(lambda module, args, out: calls.append(out.shape) or out * 2)
    model = torch.nn.Sequential(shared, other, hooked)
    assert onednn.pack_linears(model, torch.device("cpu"), torch.float32) == 1
    assert model[0] is shared and model[1] is other and isinstance(model[2], onednn.PackedLinear)
    x = torch.randn(3, 8)
    with torch.inference_mode():
        want = 2 * torch.nn.functional.linear(model[1](model[0](x)), hooked.weight, hooked.bias)
        got = model(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls == [torch.Size([3, 4])]
    handle.remove()  # the handle still reaches the hook it registered
    with torch.inference_mode():
        model(x)
    assert len(calls) == 1


@pytest.mark.parametrize("fault", ["raises", "wrong values"])
def test_a_packed_layer_failing_its_check_is_off_for_that_engine_in_one_warning(tiny_model_dir, reference_model,
                                                                                monkeypatch, fault):
    path = tiny_model_dir("llama")
    forward = onednn.PackedLinear.forward

    def broken(self, x):
        if fault == "raises":
            raise RuntimeError("could not create a primitive")
        return forward(self, x) + 1e-2

    monkeypatch.setattr(onednn.PackedLinear, "forward", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm, got = run(path)
    lines = [str(w.message) for w in caught if "oneDNN's packed linear" in str(w.message)]
    assert len(lines) == 1
    assert ("RuntimeError: could not create a primitive" in lines[0] if fault == "raises"
            else "largest difference 1.00e-02" in lines[0])
    assert llm.runner.packed_linears == 0
    assert not any(isinstance(m, onednn.PackedLinear) for m in llm.runner.model.modules())
    assert got == greedy(reference_model(path), PROMPT, 8)
    monkeypatch.undo()
    llm2, _ = run(path)  # the next engine checks again and packs
    assert llm2.runner.packed_linears > 0


def mapping_rss(path) -> int | None:
    """Resident bytes of this process's mappings of `path` (None where it is not mapped)."""
    total, inside = None, False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" not in fields[0]:
            inside = len(fields) >= 6 and fields[5] == str(path)
        elif inside and fields[0] == "Rss:":
            total = (total or 0) + int(fields[1]) * 1024
    return total


def test_packed_weights_are_not_left_resident_in_the_checkpoint_mapping(tiny_model_dir, reference_model, tmp_path):
    """The float32 weights are held once: the pages only a packed weight covered in the mmap'd
    checkpoint are given back, the other tensors' bytes (embedding, norms) still read right."""
    path = tmp_path / "llama"  # a copy no other test's model has mapped
    shutil.copytree(tiny_model_dir("llama"), path)
    llm, got = run(path)
    model = llm.runner.model
    packed = sum(m.packed_nbytes for m in model.modules() if isinstance(m, onednn.PackedLinear))
    files = list(path.glob("*.safetensors"))
    resident = sum(mapping_rss(f.resolve()) or 0 for f in files)
    size = sum(f.stat().st_size for f in files)
    assert packed > size / 2
    assert resident <= size - packed + 2 * 4096 * llm.runner.packed_linears, (resident, size, packed)
    assert got == greedy(reference_model(path), PROMPT, 8)
