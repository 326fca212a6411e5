"""4-bit checkpoints run as stored: GPTQ, AWQ (GEMM) and compressed-tensors pack-quantized W4A16
checkpoints of a tiny Llama, written here following each format's documented layout (the
compressed-tensors one packed by the compressed-tensors library itself, and read back by
transformers), are repacked into the int4 kernels at load. Their weights are the checkpoint's
own, the greedy tokens agree with transformers on the same weights dequantized in float32, and a
checkpoint that cannot run fails at load in one line naming the tensor or the setting."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.api.errors import ModelLoadError
from engine.quantization import Int4Linear
from engine.quantization.checkpoints import AWQ_ORDER
from test_parity import PROMPTS
from test_quantize_on_load import build

G = 128


def quantize(w: torch.Tensor, symmetric: bool):
    """(q (N, K) int in [0, 15] (signed [-8, 7] when symmetric), scale, z (N, K/G)), and the
    weight they stand for: scale * (q - z) (symmetric: scale * q)."""
    n, k = w.shape
    groups = w.view(n, k // G, G)
    if symmetric:
        scale = (groups.abs().amax(-1) / 7).clamp(min=1e-8)
        q = torch.round(groups / scale[..., None]).clamp(-8, 7)
        z = torch.zeros_like(scale)
    else:
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp(min=1e-8)
        z = torch.round(-low / scale).clamp(0, 15)
        q = (torch.round(groups / scale[..., None]) + z[..., None]).clamp(0, 15)
    scale = scale.half().float()  # as the checkpoint stores it
    deq = (scale[..., None] * (q - z[..., None])).view(n, k)
    return q.view(n, k).to(torch.int64), scale, z.to(torch.int64), deq


def pack(values: torch.Tensor, dim: int, order=tuple(range(8))) -> torch.Tensor:
    """Eight 4-bit values per int32 along `dim` (nibble i holds element 8c + order[i])."""
    v = values.to(torch.int64) & 0xF
    if dim == 0:
        v = v.T
    rows, cols = v.shape
    v = v.view(rows, cols // 8, 8)
    out = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for i, j in enumerate(order):
        out |= v[:, :, j] << (4 * i)
    out = torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)
    return out.T.contiguous() if dim == 0 else out


def write(fmt: str, src: Path, out: Path, **config_extra) -> tuple[Path, dict[str, torch.Tensor]]:
    """`src` (a float32 checkpoint) written as a `fmt` checkpoint under `out`; returns it and the
    dequantized weight of each quantized linear."""
    import shutil

    from transformers import AutoModelForCausalLM

    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    tensors, dequantized = {}, {}
    linears = {n: m for n, m in model.named_modules()  # (a layer the groups do not divide stays as it is)
               if isinstance(m, torch.nn.Linear) and n != "lm_head" and m.in_features % G == 0}
    seen = set()
    for name, p in model.state_dict().items():
        module = name.rsplit(".", 1)[0]
        if module not in linears and p.data_ptr() not in seen:  # a tied head once, as the embedding
            seen.add(p.data_ptr())
            tensors[name] = p.contiguous()
    for name, m in linears.items():
        w = m.weight.detach()
        q, scale, z, deq = quantize(w, symmetric=fmt == "compressed-tensors")
        dequantized[name] = deq
        if fmt == "gptq":
            tensors[f"{name}.qweight"] = pack(q.T, dim=0)
            tensors[f"{name}.qzeros"] = pack(z.T - 1, dim=1)  # v1 stores zero - 1
            tensors[f"{name}.scales"] = scale.T.half().contiguous()
            tensors[f"{name}.g_idx"] = (torch.arange(w.shape[1]) // G).to(torch.int32)
        elif fmt == "awq":
            tensors[f"{name}.qweight"] = pack(q.T, dim=1, order=AWQ_ORDER)
            tensors[f"{name}.qzeros"] = pack(z.T, dim=1, order=AWQ_ORDER)
            tensors[f"{name}.scales"] = scale.T.half().contiguous()
        else:
            from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

            tensors[f"{name}.weight_packed"] = pack_to_int32(q.to(torch.int8), 4, packed_dim=1)
            tensors[f"{name}.weight_scale"] = scale.half()
            tensors[f"{name}.weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int32)
    qc = {"gptq": {"quant_method": "gptq", "bits": 4, "group_size": G, "desc_act": False, "sym": False,
                   "checkpoint_format": "gptq"},
          "awq": {"quant_method": "awq", "bits": 4, "group_size": G, "version": "gemm", "zero_point": True},
          "compressed-tensors": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                 "quantization_status": "compressed", "ignore": ["lm_head"],
                                 "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                     "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                     "group_size": G, "dynamic": False, "observer": "minmax"}}}}}[fmt]
    qc.update(config_extra)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out, dequantized


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return build(tmp_path_factory.mktemp("packed") / "fp32")


@pytest.mark.parametrize("fmt", ["gptq", "awq", "compressed-tensors"])
def test_a_packed_checkpoint_runs_its_own_weights(fmt, source, tmp_path):
    from transformers import AutoModelForCausalLM

    path, dequantized = write(fmt, source, tmp_path / fmt)
    llm = LLMEngine(EngineConfig(model=str(path)))
    assert llm.runner.quantization == "int4" and llm.runner.streamed
    layers = {n: m for n, m in llm.runner.model.named_modules() if isinstance(m, Int4Linear)}
    assert sorted(layers) == sorted(dequantized)
    for name, layer in layers.items():  # the checkpoint's weights, through the kernels (bfloat16 scales)
        want = dequantized[name]
        assert torch.allclose(layer.dequantized(), want, atol=0.01 * float(want.abs().max())), name
    ref = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, w in dequantized.items():
            ref.get_submodule(name).weight.copy_(w)
    if fmt == "compressed-tensors":  # transformers reads this format: its decompression is ours
        from transformers.utils.quantization_config import CompressedTensorsConfig

        theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                      quantization_config=CompressedTensorsConfig(dequantize=True))
        for name, w in dequantized.items():
            assert torch.allclose(theirs.get_submodule(name).weight.float(), w, atol=1e-3 * float(w.abs().max())), name
    prompts = PROMPTS + [p[::-1] for p in PROMPTS]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    agree = 0
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([llm.tokenizer.encode(prompt)])
        want = ref.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, ids.shape[1]:].tolist()
        agree += out.token_ids == want
    assert agree >= 0.95 * len(prompts), f"{fmt}: {agree} of {len(prompts)} greedy rows agree"
    assert llm.memory["weights_bytes"] < 0.6 * llm.memory["unquantized_weights_bytes"]


def _load_error(path: Path, **config) -> str:
    with pytest.raises((ModelLoadError, ValueError)) as err:
        LLMEngine(EngineConfig(model=str(path), **config))
    assert "\n" not in str(err.value)
    return str(err.value)


def test_checkpoints_that_cannot_run_fail_at_load_in_one_line(source, tmp_path):
    from safetensors.torch import load_file

    path, _ = write("gptq", source, tmp_path / "gptq")
    assert "quantization int8 asked for, but the checkpoint is quantized with gptq" in _load_error(path, quantization="int8")
    tensors = load_file(str(path / "model.safetensors"))
    missing = dict(tensors)
    del missing["model.layers.0.self_attn.q_proj.scales"]
    save_file(missing, str(path / "model.safetensors"), metadata={"format": "pt"})
    assert "model.layers.0.self_attn.q_proj.scales: missing from the checkpoint" in _load_error(path)
    bad = dict(tensors)
    bad["model.layers.1.mlp.up_proj.scales"] = bad["model.layers.1.mlp.up_proj.scales"][:, :-8].contiguous()
    save_file(bad, str(path / "model.safetensors"), metadata={"format": "pt"})
    assert "model.layers.1.mlp.up_proj.scales: shape" in _load_error(path)
    for i, (extra, said) in enumerate((({"desc_act": True}, "desc_act true"), ({"bits": 3}, "3-bit weights"),
                                       ({"group_size": 96}, "group size 96 does not divide"))):
        cfg, _ = write("gptq", source, tmp_path / f"gptq-{i}", **extra)
        assert said in _load_error(cfg)
    for method in ("bitsandbytes", "exl2", "gguf"):
        cfg, _ = write("awq", source, tmp_path / method, quant_method=method)
        assert f"quantization method {method!r} is not supported" in _load_error(cfg)
    cfg, _ = write("awq", source, tmp_path / "gemv", version="gemv")
    assert "only the GEMM version runs" in _load_error(cfg)
