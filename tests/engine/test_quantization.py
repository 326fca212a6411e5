"""int8 weights: greedy tokens mostly equal float32's, logits within a stated error, a quarter
of the linears' bytes; fp8 is a one-line error off CUDA >= 8.9."""
from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.quantization.methods import FP8_MAX, Int8Linear
from test_parity import PROMPTS
from tiny_models import build_tiny_model

LOGIT_RTOL = 0.01
"""int8 per-channel weights: logits stay within 1% of float32's range (measured: 0.27-0.28%)."""


HEAD_GAIN = 12.0
BLOCK_GAIN = 0.2


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    """A tiny model with peaked logits: the blocks' output projections scaled down (the
    residual stream keeps most of the current token's embedding, the layers still add theirs)
    and an LM head that maps each token's embedding to a fixed successor, so every step's top
    token stands clear of the next. Greedy parity then measures int8's error, not rounding
    between the near-ties of a random model."""
    from transformers import AutoModelForCausalLM

    def build(arch):
        out = build_tiny_model(arch, tmp_path_factory.mktemp(f"peaked-{arch}"), init=0.05)
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        emb = model.get_input_embeddings().weight
        g = torch.Generator().manual_seed(1)
        successor_of = torch.randperm(emb.shape[0], generator=g)  # logits of token j peak when h ~ emb[succ^-1(j)]
        with torch.no_grad():
            for name, module in model.named_modules():
                if name.endswith(("o_proj", "down_proj")):
                    module.weight.mul_(BLOCK_GAIN)
            model.get_output_embeddings().weight.copy_(HEAD_GAIN * emb[torch.argsort(successor_of)] / emb.norm(
                dim=1, keepdim=True).mean())
        model.save_pretrained(out)
        return out

    return build


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "phi3"])
def test_int8_greedy_tokens_and_logits_stay_close_to_float32(arch, peaked):
    path = str(peaked(arch))
    full = LLMEngine(EngineConfig(model=path))
    q = LLMEngine(EngineConfig(model=path, quantization="int8"))
    assert sum(isinstance(m, Int8Linear) for m in q.runner.model.modules()) >= 4
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = PROMPTS + [p[::-1] for p in PROMPTS]
    a, b = full.generate(prompts, params), q.generate(prompts, params)
    same = sum(x.token_ids == y.token_ids for x, y in zip(a, b))
    assert same >= 0.9 * len(prompts), f"{arch}: {same} of {len(prompts)} greedy rows identical"
    ids = torch.tensor([full.tokenizer.encode(PROMPTS[2])])
    with torch.inference_mode():
        ref = full.runner.model.__class__.from_pretrained(path, dtype=torch.float32)(ids).logits
    got = _plain_logits(q, ids)
    err = (got - ref).abs().max() / (ref.max() - ref.min())
    assert err < LOGIT_RTOL, f"{arch}: logits off by {float(err):.3f} of their range"
    assert q.runner.weights_nbytes < full.runner.weights_nbytes


def _plain_logits(llm, ids):
    """The quantized model's logits on a plain forward (no engine cache)."""
    from transformers import AutoModelForCausalLM

    from engine.quantization.methods import quantize_model

    model = AutoModelForCausalLM.from_pretrained(llm.runner.model_dir, dtype=torch.float32).eval()
    quantize_model(model, "int8", torch.float32)
    with torch.inference_mode():
        return model(ids).logits


@pytest.mark.parametrize("kernel", ["onednn", "x86"])
def test_int8_linear_equals_its_dequantized_weights(kernel, monkeypatch):
    """Both CPU int8 GEMMs against torch's own definition of what they compute: oneDNN's
    _int_mm on int8 activations per token; the x86 engine's dynamic quantization (torch's
    quantize_per_tensor with the qparams it chooses, 7 bits) of each row over its largest value,
    in a [-1, 1] range."""
    from transformers.pytorch_utils import Conv1D

    from engine.quantization import methods

    if kernel == "x86" and "x86" not in torch.backends.quantized.supported_engines:
        pytest.skip("this torch has no x86 quantized engine")
    monkeypatch.setattr(methods, "_CPU_INT8", [kernel])
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    q = Int8Linear(lin.weight, lin.bias, torch.float32)
    x = torch.randn(5, 64)
    if kernel == "onednn":
        x_scale = x.abs().amax(dim=1, keepdim=True) / 127  # on CPU activations are int8 per token too
        seen = torch.round(x / x_scale) * x_scale
    else:
        rows = x.abs().amax(dim=1, keepdim=True)
        bounds = torch.zeros(1, 64)
        bounds[0, 0], bounds[0, -1] = 1.0, -1.0
        xn = torch.cat([x / rows, bounds])
        scale, zero = torch._choose_qparams_per_tensor(xn, True)  # 7 bits: the reduced range
        seen = torch.quantize_per_tensor(xn, scale, zero, torch.quint8).dequantize()[:-1] * rows
        assert torch.equal(q(x[:2]), q(torch.cat([x[:2], x[2:] * 100]))[:2])  # a row's output: not its batch's
    want = seen @ q.dequantized().T + lin.bias
    assert torch.allclose(q(x), want, atol=1e-4)
    assert (q.dequantized() - lin.weight).abs().max() <= lin.weight.abs().max() / 127 / 2 + 1e-6
    conv = Conv1D(48, 64)  # GPT-2 stores (in, out)
    torch.nn.init.normal_(conv.weight)
    cq = Int8Linear(conv.weight.T, conv.bias, torch.float32)
    assert torch.allclose(cq(x), conv(x), atol=0.05 * float(conv(x).abs().max()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_linear_asks_for_a_bfloat16_product_in_every_dtype(dtype, monkeypatch):
    """Row-wise scaled fp8 matmuls give a bfloat16 product only on most CUDA cards (a float16 or
    float32 out_dtype fails there at the first pass): the layer asks for bfloat16 and casts.
    Checked on CPU, where torch runs the same call; the result stays within fp8's error."""
    from engine.quantization.methods import Fp8Linear

    asked, scaled_mm = [], torch._scaled_mm

    def spy(*args, **kwargs):
        asked.append(kwargs["out_dtype"])
        return scaled_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    x = torch.randn(5, 64)
    y = Fp8Linear(lin.weight, lin.bias, dtype)(x.to(dtype))
    assert asked == [torch.bfloat16] and y.dtype == dtype and y.shape == (5, 48)
    want = lin(x)
    assert (y.float() - want).abs().max() < 0.1 * want.abs().max()


def test_int8_linears_hold_a_quarter_of_the_bytes(tiny_model_dir):
    path = str(tiny_model_dir("llama"))
    full = LLMEngine(EngineConfig(model=path))
    q = LLMEngine(EngineConfig(model=path, quantization="int8"))
    emb = q.runner.model.get_input_embeddings().weight
    linears = full.runner.weights_nbytes - emb.numel() * 4
    assert q.runner.weights_nbytes - emb.numel() * 4 < 0.3 * linears
    # what the engine reports it saved (stats, tune): the float32 engine's own figure
    assert q.memory["unquantized_weights_bytes"] == full.memory["weights_bytes"] == full.memory[
        "unquantized_weights_bytes"]
    assert q.memory["weights_bytes"] == q.runner.weights_nbytes


def test_fp8_off_cuda_and_unknown_methods_are_one_line_errors():
    with pytest.raises(ValueError, match="fp8 needs a CUDA device of compute capability >= 8.9") as err:
        LLMEngine(EngineConfig(model="builtin:tiny", device="cpu", quantization="fp8"))
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="quantization must be"):
        EngineConfig(quantization="int2")


def test_an_fp8_kv_pool_off_cuda_is_a_one_line_error_naming_the_device():
    with pytest.raises(ValueError, match="kv_cache_dtype fp8 needs a CUDA device of compute capability >= 8.9, "
                                         "not cpu$") as err:
        LLMEngine(EngineConfig(model="builtin:tiny", device="cpu", kv_cache_dtype="fp8"))
    assert "\n" not in str(err.value)


def compressed_checkpoint(src, out, kind: str = "int8", input_scales: dict[str, float] | None = None):
    """A compressed-tensors checkpoint of the model in `src`: W8A8 int8 (`int-quantized`) or FP8
    (`float-quantized`) weights with one scale per output channel, dynamic per-token activations
    (with `input_scales`, {layer: scale}: a static scheme's per-tensor scales), the LM head left
    as it is. Returns its tensors."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    top, dtype = (127.0, torch.int8) if kind == "int8" else (448.0, torch.float8_e4m3fn)
    shutil.copytree(src, out)
    state, packed = load_file(out / "model.safetensors"), {}
    for key, value in state.items():
        if key.endswith(".weight") and value.dim() == 2 and "embed" not in key and "lm_head" not in key:
            scale = value.abs().amax(1, keepdim=True) / top
            scaled = value / scale
            packed[key] = (torch.round(scaled).clamp(-127, 127) if kind == "int8" else scaled).to(dtype)
            packed[key[: -len("weight")] + "weight_scale"] = scale
            if input_scales is not None:
                packed[key[: -len("weight")] + "input_scale"] = torch.tensor([input_scales[key[: -len(".weight")]]])
        else:
            packed[key] = value
    save_file(packed, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    scheme = {"num_bits": 8, "type": "int" if kind == "int8" else "float", "symmetric": True}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": f"{'int' if kind == 'int8' else 'float'}-quantized",
        "quantization_status": "compressed", "ignore": ["lm_head"], "config_groups": {"group_0": {
            "targets": ["Linear"], "weights": {**scheme, "strategy": "channel", "dynamic": False},
            "input_activations": {**scheme, "strategy": "token", "dynamic": True} if input_scales is None
            else {**scheme, "strategy": "tensor", "dynamic": False}}}}
    (out / "config.json").write_text(json.dumps(config))
    return packed


def dense_copy(src, packed: dict, out):
    """The model in `src` with a compressed-tensors checkpoint's values (`packed`) dequantized into
    float32 weights: what transformers loads, the ideal rounding's reference."""
    from safetensors.torch import save_file

    out.mkdir()
    for f in src.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    weights = {k: v for k, v in packed.items() if not k.endswith(("weight_scale", "input_scale"))}
    for k in list(weights):
        if weights[k].dtype in (torch.int8, torch.float8_e4m3fn):
            weights[k] = weights[k].float() * packed[k[: -len("weight")] + "weight_scale"]
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_a_compressed_tensors_8bit_checkpoint_loads_its_values_as_stored(peaked, tmp_path, kind, arch):
    """Llama, and Qwen2 with its Q/K/V biases; the LM head the checkpoint's config ignores stays
    as stored, in float32."""
    src = peaked(arch)
    packed = compressed_checkpoint(src, tmp_path / "w8", kind)
    llm = LLMEngine(EngineConfig(model=str(tmp_path / "w8")))
    # on CPU (no fp8 matmuls) an fp8 checkpoint runs int8, each layer requantized as it is read
    assert llm.runner.checkpoint_quantization == f"compressed-tensors {kind}" and llm.runner.quantization == "int8"
    assert llm.runner.streamed  # read a layer at a time: never the whole model in full precision
    assert not isinstance(llm.runner.model.get_output_embeddings(), Int8Linear)  # (ignore: ["lm_head"])
    name = "model.layers.0.self_attn.q_proj"
    q_proj = llm.runner.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, Int8Linear)
    if kind == "int8":  # the same int8 values and scales
        assert torch.equal(q_proj.int8_weight(), packed[f"{name}.weight"])
        assert torch.equal(q_proj.scale, packed[f"{name}.weight_scale"].reshape(-1).to(q_proj.scale.dtype))
    # the same model with the dequantized weights, run in float32
    ref = LLMEngine(EngineConfig(model=str(dense_copy(src, packed, tmp_path / "dense"))))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    got, want = llm.generate(PROMPTS, params), ref.generate(PROMPTS, params)
    assert sum(a.token_ids == b.token_ids for a, b in zip(got, want)) >= 0.9 * len(PROMPTS)
    for a, b in zip(got, want):
        assert abs(next(iter(a.logprobs[0].values())) - next(iter(b.logprobs[0].values()))) < 0.05
    with pytest.raises(ValueError, match="quantization int4 asked for, but the checkpoint is quantized with "
                                         f"compressed-tensors {kind}"):
        LLMEngine(EngineConfig(model=str(tmp_path / "w8"), quantization="int4"))


@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen2", marks=pytest.mark.slow)])  # ~10 s a case
def test_w8a8_agreement_is_reported_next_to_ideal_roundings(tiny_model_dir, tmp_path, arch):
    """A W8A8 checkpoint's greedy tokens against transformers on its weights dequantized in float32,
    beside ideal rounding's: the same weights with each linear layer's inputs rounded per token to
    int8, in float32 arithmetic (what exact int8 products give). On a random model (not a peaked
    one), where rounding the activations flips some rows. The engine's products run in int8
    (torch._int_mm; where the CPU has no VNNI, the x86 engine's GEMM on 7-bit activations, and
    ideal rounding is then to that grid): it must agree as often as ideal rounding does, within one row."""
    from engine.quantization.methods import cpu_int8_kernel

    from transformers import AutoModelForCausalLM

    src = tiny_model_dir(arch)
    packed = compressed_checkpoint(src, tmp_path / "w8")
    ref = AutoModelForCausalLM.from_pretrained(dense_copy(src, packed, tmp_path / "dense"), dtype=torch.float32).eval()
    llm = LLMEngine(EngineConfig(model=str(tmp_path / "w8")))
    prompts = [llm.tokenizer.encode(p + s) for p in PROMPTS for s in ("", " and more", "?!", " 42")]
    got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))]

    def greedy(model):
        outs = []
        for p in prompts:
            ids = torch.tensor([p])
            outs.append(model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)[0, len(p):].tolist())
        return outs

    seven_bits = cpu_int8_kernel() == "x86"

    def round_per_token(module, args):
        x = args[0]
        rows = x.abs().amax(-1, keepdim=True).clamp(min=1e-12)
        if seven_bits:  # the step of uint8 0..127 over [-1, 1] (zero point 64), as torch chooses for the x86
            bounds = torch.tensor([[1.0, -1.0]])  # engine (+1 rounds to 128: quantize_per_tensor clamps to 255)
            scale, zero = torch._choose_qparams_per_tensor(bounds, True)
            q = torch.clamp(torch.round(x / rows / scale) + zero, 0, 255)
            return ((q - zero) * scale * rows,)
        step = rows / 127
        return (torch.round(x / step).clamp(-127, 127) * step,)

    want = greedy(ref)
    hooks = [m.register_forward_pre_hook(round_per_token) for name, m in ref.named_modules()
             if isinstance(m, torch.nn.Linear) and name != "lm_head"]
    ideal = greedy(ref)
    for hook in hooks:
        hook.remove()
    engine, rounded = sum(a == b for a, b in zip(got, want)), sum(a == b for a, b in zip(ideal, want))
    same = sum(a == b for a, b in zip(got, ideal))
    print(f"{arch} W8A8: {engine} of {len(prompts)} rows agree with the dequantized float32 model; "
          f"ideal rounding: {rounded}; the engine's rows are ideal rounding's on {same}")
    assert engine >= rounded - 1 and same >= len(prompts) - 2, (engine, rounded, same)


def calibrated_input_scales(src, top: float) -> dict[str, float]:
    """Each linear layer's (but the head's) largest |input| over PROMPTS through the float model,
    over `top`: the per-tensor scales a static scheme's calibration writes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(src)
    seen: dict[str, float] = {}
    hooks = [m.register_forward_hook(lambda mod, args, out, name=name: seen.__setitem__(
        name, max(seen.get(name, 0.0), float(args[0].abs().max()))))
             for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head"]
    with torch.no_grad():
        for prompt in PROMPTS:
            model(torch.tensor([tok.encode(prompt)]))
    for h in hooks:
        h.remove()
    return {name: v / top for name, v in seen.items()}


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_a_static_schemes_input_scales_quantize_the_activations_as_stored(peaked, tmp_path, kind):
    """A static activation scheme's per-tensor input_scale is read and used (on CPU an fp8 one is
    rescaled to int8's range): each product is the static scheme's, by hand, and the greedy
    tokens agree with the same weights under per-token scales."""
    import json

    from engine.api.errors import ModelLoadError

    src = peaked("llama")
    scales = calibrated_input_scales(src, 127.0 if kind == "int8" else FP8_MAX)
    packed = compressed_checkpoint(src, tmp_path / "static", kind, input_scales=scales)
    llm = LLMEngine(EngineConfig(model=str(tmp_path / "static")))
    name = "model.layers.0.self_attn.q_proj"
    layer = llm.runner.model.get_submodule(name)
    want = scales[name] * (1.0 if kind == "int8" else FP8_MAX / 127.0)
    assert float(layer.input_scale) == pytest.approx(want, rel=1e-6)
    x = torch.randn(5, layer.in_features) * 3 * float(packed[f"{name}.input_scale"]) * 127
    by_hand = (torch.round(x / want).clamp(-127, 127) @ layer.int8_weight().float().T) * (want * layer.scale.float())
    assert torch.allclose(layer(x), by_hand, atol=1e-4 * float(by_hand.abs().max()))
    compressed_checkpoint(src, tmp_path / "dynamic", kind)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    got = llm.generate(PROMPTS, params)
    ref = LLMEngine(EngineConfig(model=str(tmp_path / "dynamic"))).generate(PROMPTS, params)
    assert sum(a.token_ids == b.token_ids for a, b in zip(got, ref)) >= 0.9 * len(PROMPTS)
    config = json.loads((tmp_path / "static" / "config.json").read_text())
    group = config["quantization_config"]["config_groups"]["group_0"]
    group["input_activations"]["strategy"] = "token"
    (tmp_path / "static" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"static token input scales: only static symmetric tensor scales"):
        LLMEngine(EngineConfig(model=str(tmp_path / "static")))


def test_checkpoints_quantized_in_ways_the_engine_cannot_run_fail_at_load_in_one_line(tiny_model_dir, tmp_path):
    import json
    import shutil

    from engine.api.errors import ModelLoadError

    out = tmp_path / "w4"
    shutil.copytree(tiny_model_dir("llama"), out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                     "config_groups": {"g": {"targets": ["Linear"], "weights": {
                                         "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                         "group_size": 32}}}}
    (out / "config.json").write_text(json.dumps(config))
    # a 4-bit format the engine runs (tests/engine/test_packed_checkpoints.py), whose tensors are not there
    with pytest.raises(ModelLoadError, match="the config says compressed-tensors, but no layer holds its tensors"):
        LLMEngine(EngineConfig(model=str(out)))
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                     "config_groups": {"g": {"weights": {"num_bits": 2, "type": "int"}}}}
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="compressed-tensors checkpoint with int2 weights is not supported"):
        LLMEngine(EngineConfig(model=str(out)))
    # 8-bit ones: zero points, group scales, a scale of the wrong shape
    w8 = tmp_path / "w8"
    packed = compressed_checkpoint(tiny_model_dir("llama"), w8)
    ct = json.loads((w8 / "config.json").read_text())
    for change, said in (({"symmetric": False}, "compressed-tensors int8 checkpoint with asymmetric weights"),
                         ({"strategy": "group"}, "compressed-tensors int8 checkpoint with group weight scales")):
        bad = json.loads(json.dumps(ct))
        bad["quantization_config"]["config_groups"]["group_0"]["weights"].update(change)
        (w8 / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ModelLoadError, match=said):
            LLMEngine(EngineConfig(model=str(w8)))
    (w8 / "config.json").write_text(json.dumps(ct))
    from safetensors.torch import save_file

    name = "model.layers.0.mlp.up_proj.weight_scale"
    save_file({**packed, name: packed[name][:4]}, w8 / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=rf"{name}: shape \(4, 1\), expected \(\d+, 1\) or \(1,\)"):
        LLMEngine(EngineConfig(model=str(w8)))
    # a layer's int8 or fp8 values without their scale (loaded as floats, they would be ~100x off)
    for kind, stored in (("int8", "int8"), ("fp8", "float8_e4m3fn")):
        w8k = tmp_path / f"w8-{kind}"
        packed_k = compressed_checkpoint(tiny_model_dir("llama"), w8k, kind)
        save_file({k: v for k, v in packed_k.items() if k != name}, w8k / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ModelLoadError) as err:
            LLMEngine(EngineConfig(model=str(w8k)))
        assert (f"{name}: missing from the checkpoint (its model.layers.0.mlp.up_proj.weight is {stored})"
                in str(err.value) and "\n" not in str(err.value)), str(err.value)
    # a static scheme's input scale: missing, or more than one value
    static = tmp_path / "w8-static"
    layers = [k[: -len(".weight")] for k, v in packed.items() if k.endswith(".weight") and v.dtype == torch.int8]
    packed_s = compressed_checkpoint(tiny_model_dir("llama"), static, input_scales=dict.fromkeys(layers, 0.05))
    scale = "model.layers.0.self_attn.k_proj.input_scale"
    for tensors, said in (({k: v for k, v in packed_s.items() if k != scale},
                           rf"{scale}: missing from the checkpoint \(its activations' scheme is static\)"),
                          ({**packed_s, scale: torch.tensor([0.05, 0.06])},
                           rf"{scale}: shape \(2,\), expected one value")):
        save_file(tensors, static / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ModelLoadError, match=said):
            LLMEngine(EngineConfig(model=str(static)))
    config["quantization_config"] = {"quant_method": "hqq", "nbits": 4}
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as err:
        LLMEngine(EngineConfig(model=str(out)))
    assert "quantization method 'hqq' is not supported" in str(err.value) and "\n" not in str(err.value)


def test_moe_experts_left_unquantized_are_said_at_load(tiny_model_dir, caplog):
    """Mixtral's experts are 3-D tensors, not linear layers: int8 leaves them as they are, and
    says so (most of a real MoE model's bytes are there)."""
    with caplog.at_level("WARNING", logger="engine.quantization.methods"):
        llm = LLMEngine(EngineConfig(model=str(tiny_model_dir("mixtral")), quantization="int8"))
    warned = [r.getMessage() for r in caplog.records if "MoE experts" in r.getMessage()]
    assert len(warned) == 1 and "stay in float32" in warned[0]
    experts = sum(p.numel() for p in llm.runner.model.parameters() if p.ndim >= 3)
    from engine.quantization.methods import Int8Linear

    linear = sum(m.in_features * m.out_features for m in llm.runner.model.modules() if isinstance(m, Int8Linear))
    others = sum(p.numel() for p in llm.runner.model.parameters() if p.ndim < 3)
    share = round(100 * experts / (experts + linear + others))
    assert f"({share}% of the model's)" in warned[0] and share < 100
    assert llm.memory["weights_bytes"] < llm.memory["unquantized_weights_bytes"]


def test_layers_whose_shapes_the_cuda_kernels_refuse_stay_in_the_models_dtype():
    """On CUDA, int8's GEMM takes sizes that are multiples of 8 and fp8's _scaled_mm multiples of
    16: another layer stays in the model's dtype (it converted its whole weight at every forward,
    or would fail at the first). On CPU, oneDNN's int8 takes any. (Decided from the shapes alone,
    so no GPU is needed.)"""
    from engine.quantization.methods import quantizer

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert quantizer("int8", "q_proj", torch.nn.Linear(60, 36), None, torch.bfloat16, cuda) is None
    assert quantizer("int8", "q_proj", torch.nn.Linear(64, 48), None, torch.bfloat16, cuda) is not None
    assert quantizer("int8", "q_proj", torch.nn.Linear(60, 36), None, torch.float32, cpu) is not None
    assert quantizer("fp8", "q_proj", torch.nn.Linear(64, 40), None, torch.bfloat16, cuda) is None
    assert quantizer("fp8", "q_proj", torch.nn.Linear(64, 48), None, torch.bfloat16, cuda) is not None


def test_a_gguf_file_or_a_directory_holding_one_is_read_and_a_cut_one_refused_in_one_line(tmp_path):
    """GGUF is a model format now (tests/engine/test_gguf.py); a file cut after its header's
    first bytes, named or found alone in a directory, is refused naming it."""
    from engine.api.errors import ModelLoadError

    header = b"GGUF" + (3).to_bytes(4, "little") + (0).to_bytes(8, "little") + (5).to_bytes(8, "little")
    (tmp_path / "model-Q4_K_M.gguf").write_bytes(header + b"\x00" * 6)  # five keys promised, none there
    for ref in (tmp_path, tmp_path / "model-Q4_K_M.gguf"):
        with pytest.raises(ModelLoadError) as err:
            LLMEngine(EngineConfig(model=str(ref)))
        said = str(err.value)
        assert "model-Q4_K_M.gguf: truncated GGUF file" in said and "\n" not in said
