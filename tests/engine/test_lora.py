"""LoRA adapters: rows of several adapters and the base model in one pass give, token for token,
transformers' greedy generate on each adapter's merged model (PEFT's merge_and_unload), in both
scheduling modes, under preemption, and with more adapters than slots; prefix-cache blocks are
never shared across adapters; bad adapters are refused in one line naming them."""
from __future__ import annotations

import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import AdapterError, EngineConfig, LLMEngine, LoRARequest, SamplingParams
from lora_models import ALL_PROJECTIONS, edit_config, greedy, make_adapter, merged
from tiny_models import build_tiny_model

pytest.importorskip("peft")

MAX_NEW = 10


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """A tiny Llama and three adapters: rank 8 on q/v, rank 16 on all 7 projections (rsLoRA), rank 8 on the MLP."""
    root = tmp_path_factory.mktemp("lora")
    base = build_tiny_model("llama", root / "llama")
    adapters = {"qv": make_adapter(base, root / "qv", 8, ["q_proj", "v_proj"], seed=1),
                "all": make_adapter(base, root / "all", 16, ALL_PROJECTIONS, seed=2, rslora=True),
                "mlp": make_adapter(base, root / "mlp", 8, ["up_proj", "down_proj"], seed=3)}
    requests = {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}
    return base, adapters, requests


def prompts(n: int) -> list[list[int]]:
    return [[3 + i % 50, 17, 40 + 3 * i % 90, 90, 2 + i % 7, 11 + i % 13, 60, 61 + i % 5, 8, 9, 70 + i, 33]
            for i in range(n)]


def references(base, adapters, rows, loras) -> list[list[int]]:
    models = {}
    out = []
    for ids, lora in zip(rows, loras):
        key = lora.lora_name if lora else None
        if key not in models:
            models[key] = merged(base, adapters[key] if key else None)
        out.append(greedy(models[key], ids, MAX_NEW))
    return out


@pytest.mark.parametrize("scheduling,pool", [("static", None), ("continuous", None), ("continuous", 96)])
def test_mixed_adapters_in_one_batch_match_each_merged_model(family, scheduling, pool):
    base, adapters, requests = family
    rows = prompts(12)
    loras = [[None, requests["qv"], requests["all"], requests["mlp"]][i % 4] for i in range(12)]
    llm = LLMEngine(EngineConfig(model=str(base), enable_lora=True, scheduling=scheduling, max_batch_tokens=pool))
    outs = llm.generate(rows, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True), lora_request=loras)
    want = references(base, adapters, rows, loras)
    assert [o.token_ids for o in outs] == want
    assert all(o.error is None for o in outs)
    base_only = LLMEngine(EngineConfig(model=str(base))).generate(rows, SamplingParams(max_tokens=MAX_NEW, temperature=0,
                                                                                        ignore_eos=True))
    changed = [o.token_ids != b.token_ids for o, b in zip(outs, base_only)]
    assert changed == [lora is not None for lora in loras]  # every adapter changes its rows, the base rows stay
    if pool is not None:
        assert sum(s.preemptions for s in llm.batch_stats) > 0  # the small pool preempted rows mid-batch


def test_more_adapters_than_slots_run_in_waves_with_tokens_unchanged(family, tmp_path):
    base, adapters, requests = family
    extra = {f"x{k}": make_adapter(base, tmp_path / f"x{k}", 4, ["q_proj", "o_proj"], seed=10 + k) for k in range(3)}
    paths = {**adapters, **extra}
    reqs = [LoRARequest(name, i + 1, str(p)) for i, (name, p) in enumerate(paths.items())]  # 6 adapters
    rows = prompts(12)
    loras = [reqs[i % 6] for i in range(12)]
    llm = LLMEngine(EngineConfig(model=str(base), enable_lora=True, max_loras=2, max_cpu_loras=3,
                                 scheduling="continuous"))
    outs = llm.generate(rows, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True), lora_request=loras)
    assert all(o.error is None for o in outs)
    assert [o.token_ids for o in outs] == references(base, paths, rows, loras)
    assert llm.adapters.slots.evictions >= 4


def test_prefix_cache_blocks_are_never_shared_across_adapters(family):
    base, adapters, requests = family
    prompt = list(range(5, 5 + 40))  # more than two full blocks
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    llm = LLMEngine(EngineConfig(model=str(base), enable_lora=True))
    first = llm.generate([prompt], sp, lora_request=requests["all"])[0]
    second = llm.generate([prompt], sp, lora_request=requests["qv"])[0]  # same tokens, another adapter
    again = llm.generate([prompt], sp, lora_request=requests["qv"])[0]
    assert second.num_cached_tokens == 0 and again.num_cached_tokens == 32  # its own blocks only
    solo = {name: LLMEngine(EngineConfig(model=str(base), enable_lora=True, enable_prefix_caching=False)).generate(
        [prompt], sp, lora_request=requests[name])[0].token_ids for name in ("all", "qv")}
    assert first.token_ids == solo["all"] and second.token_ids == again.token_ids == solo["qv"]


def test_choice_scoring_and_a_list_of_requests_follow_each_adapter(family):
    base, adapters, requests = family
    llm = LLMEngine(EngineConfig(model=str(base), enable_lora=True))
    rows, choices = prompts(4), [[[7], [8, 9]]] * 4
    loras = [None, requests["qv"], None, requests["all"]]
    mixed = llm.score_choices(rows, choices, lora_request=loras)
    for row, ch, lora, got in zip(rows, choices, loras, mixed):
        alone = llm.score_choices([row], [ch], lora_request=lora)[0]
        assert got.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    assert mixed[1].logprobs != pytest.approx(llm.score_choices([rows[1]], [choices[1]])[0].logprobs, abs=1e-3)
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(rows, SamplingParams(max_tokens=2), lora_request=loras[:3])


def test_bad_adapters_fail_their_rows_in_one_line_naming_them(family, tmp_path):
    base, adapters, requests = family
    dora = shutil.copytree(adapters["qv"], tmp_path / "dora")
    edit_config(dora, use_dora=True)
    corrupt = shutil.copytree(adapters["qv"], tmp_path / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    wide = shutil.copytree(adapters["qv"], tmp_path / "wide")  # lora_A of another model's hidden size
    tensors = load_file(wide / "adapter_model.safetensors")
    tensors = {k: torch.cat([v, v], dim=1) if "lora_A" in k else v for k, v in tensors.items()}
    save_file(tensors, wide / "adapter_model.safetensors")
    cases = {"missing": (str(tmp_path / "nowhere"), "no directory"),
             "dora": (str(dora), "DoRA"), "corrupt": (str(corrupt), "corrupt"),
             "rank": (str(adapters["all"]), "rank 16 exceeds max_lora_rank \\(8\\)"),
             "wide": (str(wide), "does not match the base model: model.layers.0.self_attn.q_proj maps")}
    llm = LLMEngine(EngineConfig(model=str(base), enable_lora=True, max_lora_rank=8))
    reqs = [LoRARequest(name, i + 1, path) for i, (name, (path, _)) in enumerate(cases.items())]
    outs = llm.generate(prompts(len(reqs) + 1), SamplingParams(max_tokens=3), lora_request=reqs + [None])
    for out, (name, (_, message)) in zip(outs, cases.items()):
        assert out.finish_reason == "error" and out.error.startswith(f"adapter {name}: ")
        assert re.search(message, out.error), out.error
        assert "\n" not in out.error
    assert outs[-1].error is None  # the base model's row goes on
    seq = LLMEngine(EngineConfig(model=str(base))).add_request([5, 6], None, requests["qv"])
    assert seq.finish_reason == "error" and seq.error == "adapter qv: LoRA is not enabled (set enable_lora)"


def test_tensor_parallel_ranks_shard_each_adapter_as_its_layer(family, tmp_path):
    """Two CPU ranks (gloo): adapters on column- and row-parallel projections give one process's tokens."""
    base, adapters, requests = family
    rows, loras = prompts(6), [None, requests["all"], requests["qv"], requests["mlp"], requests["all"], None]
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    one = LLMEngine(EngineConfig(model=str(base), enable_lora=True)).generate(rows, sp, lora_request=loras)
    with LLMEngine(EngineConfig(model=str(base), enable_lora=True, tensor_parallel_size=2)) as llm:
        two = llm.generate(rows, sp, lora_request=loras)
    assert [o.token_ids for o in two] == [o.token_ids for o in one] and all(o.error is None for o in two)


def test_a_quantized_base_takes_adapters_in_its_dtype(family):
    base, adapters, requests = family
    rows = prompts(4)
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    llm = LLMEngine(EngineConfig(model=str(base), enable_lora=True, quantization="int8"))
    plain = llm.generate(rows, sp)
    adapted = llm.generate(rows, sp, lora_request=requests["all"])
    assert all(o.error is None for o in adapted)
    assert all(a.token_ids != p.token_ids for a, p in zip(adapted, plain))  # the adapter acts on int8 layers
    layers = [m for m in llm.runner.model.modules() if type(m).__name__ == "LoRALinear"]
    assert layers and all(type(m.base).__name__ != "Linear" for m in layers)
    assert all(a is None or a.dtype == llm.runner.dtype for m in layers for a in m.a)


def test_embeddings_under_an_adapter_equal_the_merged_models(family, tmp_path):
    """The pooling calls take lora_request too: a decoder's last-token embedding under an adapter."""
    base, adapters, requests = family
    model = merged(base, adapters["all"])
    model.save_pretrained(tmp_path / "merged")
    for f in base.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, tmp_path / "merged" / f.name)
    rows = prompts(5)
    llm = LLMEngine(EngineConfig(model=str(base), enable_lora=True))
    got = llm.embed(rows, lora_request=[requests["all"], None, requests["all"], None, requests["all"]])
    want = LLMEngine(EngineConfig(model=str(tmp_path / "merged"))).embed(rows)
    plain = llm.embed(rows)
    for i, (g, w, p) in enumerate(zip(got, want, plain)):
        assert g.error is None
        assert g.embedding == pytest.approx(w.embedding if i % 2 == 0 else p.embedding, abs=1e-5)
    assert got[0].embedding != pytest.approx(plain[0].embedding, abs=1e-3)


def test_openai_batch_lines_take_the_adapter_their_body_model_names(family, tmp_path):
    validate = pytest.importorskip("pipeline.spec", reason="the job runner's spec needs pydantic").validate
    from pipeline.spec import Row
    from pipeline.tasks import TaskRunner

    base, adapters, requests = family
    spec = validate({"model": str(base), "input": {"path": str(tmp_path / "in.jsonl"), "format": "openai_batch"},
                     "output": {"path": str(tmp_path / "out"), "format": "openai_batch"},
                     "lora": {"adapters": {"all": str(adapters["all"])}}})
    llm = LLMEngine(spec.engine_config())
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings", "body": {"model": m, "input": [5, 6, 7]}}
             for i, m in enumerate(["all", "base-model"])]
    lines += [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
               "body": {"model": m, "prompt": "abc", "max_tokens": MAX_NEW, "temperature": 0}}
              for i, m in enumerate(["all", "gpt-4o-mini"])]
    runner = TaskRunner(spec, llm)
    results = runner.run(Row.batch(lines, ["e0", "e1", "c0", "c1"]))
    assert [r.adapter for r in results] == ["all", None, "all", None]
    assert [r.error for r in results] == [None] * 4
    want = [llm.embed([[5, 6, 7]], lora_request=requests["all"])[0].embedding, llm.embed([[5, 6, 7]])[0].embedding]
    for r, w in zip(results, want):
        assert r.pooled[0].embedding == pytest.approx(w, abs=1e-6)
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    outs = [llm.generate(["abc"], sp, lora_request=lr)[0] for lr in (requests["all"], None)]
    assert outs[0].token_ids != outs[1].token_ids
    assert [r.generated_text for r in results[2:]] == [o.text for o in outs]


def test_every_lora_config_field_is_applied_ignored_or_refused():
    """The engine's three tables cover peft.LoraConfig's fields exactly: a PEFT upgrade that adds a
    field fails here until it is placed."""
    import dataclasses

    from peft import LoraConfig

    from engine.lora.adapters import APPLIED, IGNORED, REFUSED

    tables = [set(APPLIED), set(IGNORED), set(REFUSED)]
    assert not (tables[0] & tables[1] or tables[0] & tables[2] or tables[1] & tables[2])
    assert set().union(*tables) == {f.name for f in dataclasses.fields(LoraConfig)}


def test_an_adapter_with_lora_bias_is_refused_not_run_silently_wrong(family, tmp_path):
    """PEFT's lora_bias=True puts a bias on lora_B. Its tensor lora_B.bias was read as the B part of
    an adapter named "bias", then overwritten by the weight: tokens differed from PEFT's with no
    error. Now the config's lora_bias, or a lora_B.bias tensor alone, is refused in one line."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base, adapters, _ = family
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                           LoraConfig(r=4, target_modules=["q_proj"], lora_bias=True, init_lora_weights=False))
    model.save_pretrained(tmp_path / "biased")
    assert any(k.endswith("lora_B.bias") for k in load_file(tmp_path / "biased" / "adapter_model.safetensors"))
    hidden = shutil.copytree(tmp_path / "biased", tmp_path / "hidden")
    edit_config(hidden, lora_bias=False)  # the tensor alone, its config silent
    llm = LLMEngine(EngineConfig(model=str(base), enable_lora=True))
    outs = llm.generate(prompts(3), SamplingParams(max_tokens=3), lora_request=[
        LoRARequest("biased", 1, str(tmp_path / "biased")), LoRARequest("hidden", 2, str(hidden)), None])
    assert outs[0].finish_reason == "error" and "lora_bias (a bias on lora_B) is not supported" in outs[0].error
    assert outs[1].finish_reason == "error" and "lora_B.bias is a LoRA bias (lora_bias)" in outs[1].error
    assert outs[2].error is None
