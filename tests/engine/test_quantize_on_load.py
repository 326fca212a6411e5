"""int4 weights (weight-only, groups of 128, torch's packed kernels) and quantizing while loading:
the int4 layer is its dequantized weights; greedy tokens agree with transformers on the same model
with its weights dequantized in float32; a model quantized as it is read equals one loaded whole
and quantized after; and the load's peak memory, in a fresh process, stays within the quantized
weights + the largest tensor in full precision + 10%."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.models import byte_tokenizer
from engine.quantization.int4 import GROUP_SIZE, Int4Linear, int4_supported
from engine.quantization.methods import Int8Linear
from test_parity import PROMPTS

ROOT = Path(__file__).resolve().parents[2]


def build(out: Path, arch: str = "llama", hidden: int = 128, layers: int = 2, vocab: int = 512,
          peaked: bool = True) -> Path:
    """A random model whose linear layers the int4 kernels take (K a multiple of 128). Peaked:
    the blocks' output projections scaled down and a head mapping each token to a fixed successor,
    so greedy parity measures int4's error, not rounding between a random model's near-ties."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
    config = cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                 eos_token_id=2, pad_token_id=0, initializer_range=0.05, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    if peaked:
        emb = model.get_input_embeddings().weight
        successor = torch.randperm(vocab, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            for name, module in model.named_modules():
                if name.endswith(("o_proj", "down_proj")):
                    module.weight.mul_(0.2)
            model.get_output_embeddings().weight.copy_(12.0 * emb[torch.argsort(successor)] / emb.norm(dim=1).mean())
    model.save_pretrained(out, safe_serialization=True)
    byte_tokenizer().save_pretrained(out)
    return out


def test_int4_layer_is_its_dequantized_weights_within_half_a_step():
    torch.manual_seed(0)
    w, bias = torch.randn(256, 384), torch.randn(256)
    layer = Int4Linear.from_weight(w, bias, torch.float32, torch.device("cpu"))
    deq = layer.dequantized()
    groups = w.view(256, -1, GROUP_SIZE)
    step = (groups.amax(-1) - groups.amin(-1)) / 15  # one rounding step per group
    err = (deq.view(256, -1, GROUP_SIZE) - groups).abs()
    assert bool((err <= step[..., None] / 2 + 0.01 * step[..., None] + 1e-2).all())  # bfloat16 scales
    x = torch.randn(5, 384)
    ref = x.bfloat16().float() @ deq.T + bias
    assert torch.allclose(layer(x), ref, rtol=0.02, atol=0.05 * float(ref.abs().mean()))
    assert layer(x).dtype == torch.float32
    assert not int4_supported(100, 384, torch.device("cpu")) and not int4_supported(256, 200, torch.device("cpu"))
    assert int4_supported(256, 200, torch.device("cpu"), pad=True) and not int4_supported(100, 200, torch.device("cpu"),
                                                                                          pad=True)


def test_an_int4_layer_whose_inputs_no_group_divides_is_padded_to_the_next_group():
    """K = 200: one group of 128 and one of 72 real columns. The last group's range is its own
    columns' (its padding repeats the last one), and the product is the dequantized weight's."""
    torch.manual_seed(0)
    w, bias = torch.randn(256, 200), torch.randn(256)
    w[:, 128:] = 2 + 0.05 * w[:, 128:]  # a narrow last group: zeros in its padding would widen its range 7-fold
    layer = Int4Linear.from_weight(w, bias, torch.float32, torch.device("cpu"))
    deq = layer.dequantized()
    assert deq.shape == (256, 200) and layer.qweight_in == 256
    for cols in (slice(0, 128), slice(128, 200)):
        group = w[:, cols]
        step = (group.amax(-1) - group.amin(-1)) / 15
        assert bool(((deq[:, cols] - group).abs() <= 0.51 * step[:, None] + 0.015).all())  # (bfloat16 zero points)
    x = torch.randn(3, 7, 200)
    ref = x.bfloat16().float() @ deq.T + bias
    out = layer(x)
    assert out.shape == (3, 7, 256)
    assert torch.allclose(out, ref, rtol=0.02, atol=0.05 * float(ref.abs().mean()))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama 192 wide"])
def test_int4_greedy_tokens_agree_with_transformers_on_the_dequantized_model(arch, tmp_path):
    """Every projection in int4, the head in float32; 192 wide (as SmolLM's 576 and 960, no group
    of 128 divides its inputs), every layer's inputs padded to the next group."""
    from transformers import AutoModelForCausalLM

    arch, _, wide = arch.partition(" ")
    path = build(tmp_path / arch, arch, hidden=int(wide.split()[0]) if wide else 128)
    q = LLMEngine(EngineConfig(model=str(path), quantization="int4"))
    layers = {n: m for n, m in q.runner.model.named_modules() if isinstance(m, Int4Linear)}
    assert len(layers) == 7 * 2 and q.runner.streamed  # every projection; the head stays float32
    assert type(q.runner.model.get_output_embeddings()).__name__ != "Int4Linear"
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():  # the reference: transformers on the same model, its weights dequantized
        for name, layer in layers.items():
            ref.get_submodule(name).weight.copy_(layer.dequantized())
    prompts = PROMPTS + [p[::-1] for p in PROMPTS]
    outs = q.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    agree = 0
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([q.tokenizer.encode(prompt)])
        want = ref.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, ids.shape[1]:].tolist()
        agree += out.token_ids == want
    assert agree >= 0.95 * len(prompts), f"{arch}: {agree} of {len(prompts)} greedy rows agree"


@pytest.mark.parametrize("method,arch", [("int8", "llama"), ("int4", "llama"), ("int8", "gpt2")])
def test_quantized_as_read_equals_loaded_whole_then_quantized(method, arch, tmp_path, monkeypatch, tiny_model_dir):
    import engine.runner.model_runner as model_runner

    path = build(tmp_path / "m") if arch == "llama" else tiny_model_dir(arch)
    streamed = LLMEngine(EngineConfig(model=str(path), quantization=method))
    monkeypatch.setattr(model_runner, "load_model_quantized", lambda *args, **kwargs: None)
    whole = LLMEngine(EngineConfig(model=str(path), quantization=method))
    assert streamed.runner.streamed and not whole.runner.streamed
    a, b = streamed.runner.model.state_dict(), whole.runner.model.state_dict()
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert streamed.memory["unquantized_weights_bytes"] == whole.memory["unquantized_weights_bytes"]
    assert streamed.memory["weights_bytes"] == whole.memory["weights_bytes"]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in streamed.generate(PROMPTS, params)] == [o.token_ids for o in whole.generate(PROMPTS, params)]
    kind = Int8Linear if method == "int8" else Int4Linear
    assert any(isinstance(m, kind) for m in streamed.runner.model.modules())


PEAK_CHILD = textwrap.dedent("""
    import json, sys
    import torch, transformers, transformers.modeling_utils
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.runner.model_runner import ModelRunner
    from engine.quantization.streaming import SafetensorsFiles
    def status():
        f = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
        return {k: int(f[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}
    method = None if sys.argv[2] == "none" else sys.argv[2]  # (none: the checkpoint's own)
    config = EngineConfig(model=sys.argv[1], quantization=method, device="cpu", tensor_parallel_size=int(sys.argv[4]))
    # a load of a tiny model of the same family first: the imports a load makes (~200 MiB of
    # modules), the kernels' first calls; it leaves a few hundred KiB for the next load to reuse
    warm = LLMEngine(EngineConfig(model=sys.argv[3], quantization=method or "int8", device="cpu", max_batch_tokens=64))
    warm.generate([[1, 5, 6]], SamplingParams(max_tokens=2))
    del warm
    before = status()["VmRSS"]
    runner = ModelRunner(config)
    files = SafetensorsFiles(runner.model_dir)
    largest = max(4 * torch.Size(files.shape(n)).numel() for n in files.entries)
    whole = sum(4 * torch.Size(files.shape(n)).numel() for n in files.entries)  # every tensor in float32
    print("PEAK " + json.dumps({"added": status()["VmHWM"] - before, "weights": runner.weights_nbytes,
                                "largest": largest, "whole": whole, "streamed": runner.streamed,
                                "reported": runner.load_peak_bytes, "ranks": runner.rank_loads}))
    runner.close()
""")


# Each case measures a fresh process (~10 s): the fast part keeps one format quantized on load and one
# packed checkpoint loaded as stored; the other formats and the two-rank loads are in the slow part.
@pytest.mark.parametrize("method", ["int8", *(pytest.param(m, marks=pytest.mark.slow) for m in (
                                        "int4", "compressed-tensors int8", "compressed-tensors fp8")), "gptq",
                                    *(pytest.param(m, marks=pytest.mark.slow) for m in (
                                        "compressed-tensors int4", "int8 over 2 ranks",
                                        "compressed-tensors int4 over 2 ranks"))])
def test_the_load_peak_stays_within_the_quantized_weights_and_one_tensor(method, tmp_path):
    """In a fresh process, a tiny model's load first (imports, kernels' first calls); then the
    model's load, its VmHWM rise against the bound. A compressed-tensors W8A8 checkpoint's
    values load as stored, under the same bound; so does rank 0 of two, against its own share
    of the weights (each rank reads its slices and quantizes them as it reads)."""
    from test_packed_checkpoints import write
    from test_quantization import compressed_checkpoint

    ranks = "2" if method.endswith("over 2 ranks") else "1"
    method = method.removesuffix(" over 2 ranks")
    packed4 = method in ("compressed-tensors int4", "gptq")
    path = build(tmp_path / "m", hidden=256, layers=4, vocab=8192, peaked=False)
    warm = build(tmp_path / "warm", peaked=False)
    if method in ("compressed-tensors int8", "compressed-tensors fp8"):  # (fp8 runs int8 on CPU, requantized)
        path, kind, method = tmp_path / "ct", method.split()[-1], "none"
        compressed_checkpoint(tmp_path / "m", path, kind)
    elif method in ("compressed-tensors int4", "gptq"):
        path, method = write(method.split()[0], tmp_path / "m", tmp_path / "ct4")[0], "int4"
    proc = subprocess.run([sys.executable, "-c", PEAK_CHILD, str(path), method, str(warm), ranks], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("PEAK ")), None)
    assert line is not None, proc.stderr[-3000:]
    r = json.loads(line[5:])
    assert r["streamed"]
    bound = 1.1 * (r["weights"] + r["largest"])
    print(method, {k: v / 2**20 for k, v in r.items() if isinstance(v, int) and not isinstance(v, bool)}, bound / 2**20)
    # the engine's own figure (manifest, stats): the weights' load alone, within the whole runner's
    assert 0 < r["reported"] <= r["added"]
    assert r["reported"] <= bound, f"{method}: the load added {r['reported'] / 2**20:.1f} MiB, bound {bound / 2**20:.1f} MiB"
    # (the bound is loose where the 8k-token embedding is the largest tensor: a load of the whole
    # model in float32 then quantized would peak at `whole`, well above; a 4-bit checkpoint's
    # values are packed, and nothing but a layer-by-layer load reads them)
    if not packed4 and ranks == "1":
        assert r["reported"] < 0.8 * r["whole"], (r["reported"], r["whole"])
    assert len(r["ranks"]) == int(ranks) - 1
    for i, rank in enumerate(r["ranks"], 1):  # each other rank, as its own process measured it
        rank_bound = 1.1 * (rank["weights_bytes"] + r["largest"])
        print(f"rank {i}", rank["load_peak_bytes"] / 2**20, rank["weights_bytes"] / 2**20, rank_bound / 2**20)
        assert 0 < rank["load_peak_bytes"] <= rank_bound, (i, rank, rank_bound)


def test_the_cpu_packing_of_row_blocks_is_the_whole_layers():
    from engine.quantization.int4 import _pack_cpu

    q = torch.randint(0, 16, (4096, 512), dtype=torch.uint8)  # packed 512 rows at a time
    assert torch.equal(_pack_cpu(q), torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1))
