"""Every fast path is checked against its reference before an engine trusts it
(engine.runner.fast_paths), tested on CPU by injecting faults: a kernel that raises, one that
returns wrong values, a graph capture that fails, a graph whose replay disagrees, a quantized GEMM
that is wrong. The job's tokens stay those of the reference path, the warning comes once per
engine, the engine's facts (the manifest's engines) say which path fell back, and
strict_kernels makes the fallback an error."""
from __future__ import annotations

import logging
import types

import pytest
import torch

from engine import EngineConfig, FastPathError, LLMEngine, SamplingParams
from engine.runner import attention
from engine.runner.fast_paths import DequantizedLinear, FastPaths, relative_difference
from graph_stand_ins import stand_in_cuda_graphs
from jobs.cli import report_table

PROMPTS = ["Hello there", "The quick brown fox jumps", "abc", "A longer prompt that spans a few blocks", "x"]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def tiny(**kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model="builtin:tiny", dtype="float32", device="cpu", max_num_seqs=8,
                                  block_size=8, **kw))


def tokens(llm: LLMEngine) -> list[list[int]]:
    return [c.token_ids for c in llm.generate(PROMPTS, PARAMS)]


def reference_kernel(**overrides):
    """A stand-in for the C++ kernel module: the reference, or with `overrides` a faulty one."""
    def paged_attention(q, k, v, tables, rows, ctx, scale, window, softcap):
        max_ctx = int(ctx.max()) if ctx.numel() else 1
        return attention.reference_token_attention(q, k, v, tables, rows, ctx, max_ctx, scale, window, softcap)

    return types.SimpleNamespace(paged_attention=overrides.get("paged_attention", paged_attention))


def raising(*args):
    raise RuntimeError("illegal instruction in the kernel")


def wrong(q, *args):
    return torch.zeros_like(q)


@pytest.fixture
def reference_tokens(monkeypatch):
    monkeypatch.setattr(attention, "_KERNEL", [None])  # the torch path
    return tokens(tiny())


def fell_back(caplog, path: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"{path} failed its check")]


@pytest.mark.parametrize("fault", [raising, wrong], ids=["raises", "wrong-values"])
def test_a_faulty_cpu_kernel_falls_back_for_that_engine_only(monkeypatch, caplog, reference_tokens, fault):
    monkeypatch.setattr(attention, "_KERNEL", [reference_kernel(paged_attention=fault)])
    llm = tiny()
    with caplog.at_level(logging.WARNING):
        assert tokens(llm) == reference_tokens
        assert tokens(llm) == reference_tokens  # many passes, layers and calls: still one warning
    warned = fell_back(caplog, "cpu_attention")
    assert len(warned) == 1 and "the torch attention instead" in warned[0]
    assert ("RuntimeError: illegal instruction" if fault is raising else "differs from the reference by 1") in warned[0]
    facts = llm.facts().fast_paths
    assert facts["cpu_attention"].startswith("fell back: ")
    # another engine decides for itself: with a kernel that works, it is checked and used
    calls = []

    def counted(*args):
        calls.append(1)
        return reference_kernel().paged_attention(*args)

    monkeypatch.setattr(attention, "_KERNEL", [reference_kernel(paged_attention=counted)])
    good = tiny()
    assert tokens(good) == reference_tokens and len(calls) > 1
    assert good.facts().fast_paths == {"cpu_attention": "checked"}
    assert llm.facts().fast_paths["cpu_attention"].startswith("fell back")


def test_strict_kernels_turns_a_fallback_into_an_error(monkeypatch):
    monkeypatch.setattr(attention, "_KERNEL", [reference_kernel(paged_attention=wrong)])
    with pytest.raises(FastPathError, match=r"cpu_attention failed its check .*strict_kernels is set"):
        tiny(strict_kernels=True).generate(PROMPTS, PARAMS)


def test_the_real_cpu_kernel_passes_its_check(monkeypatch):
    kernel = attention.load_cpu_kernel(wait=True)
    if kernel is None:
        pytest.skip("the C++ kernel cannot be built here (no compiler)")
    monkeypatch.setattr(attention, "_KERNEL", [kernel])
    llm = tiny(strict_kernels=True)
    tokens(llm)
    assert llm.runner.paths.facts() == {"cpu_attention": "checked"}
    assert llm.runner.paths.check_seconds["cpu_attention"] < 1.0


def test_the_triton_paths_are_checked_at_the_layers_shapes(monkeypatch):
    """The Triton kernels run only on CUDA; here the check itself is held on CPU through a
    stand-in module: right answers keep the path, a raise turns it off, at the pool's shapes."""
    seen = []

    def paged_decode(q, k, v, tables, rows, ctx, max_ctx, scale, window, softcap):
        seen.append((tuple(q.shape[1:]), tuple(k.shape[1:]), k.dtype, window))
        return attention.reference_token_attention(q, k, v, tables, rows, ctx, max_ctx, scale, window, softcap)

    def chunk(q, k, v, tables, spans, max_len, out, scale, window, softcap):
        t0, t1, row, start = spans[0].tolist()
        out[t0:t1] = attention.chunk_attention(q[t0:t1], k, v, tables[row], start, scale, window, softcap)

    module = types.SimpleNamespace(paged_decode=paged_decode, chunk_attention=chunk)
    q = torch.randn(5, 4, 16)
    k_pool = torch.zeros(10, 2, 8, 16)
    paths = FastPaths()
    assert attention.checked_kernel(paths, "triton_decode", module, q, k_pool, 4, 0.0)
    assert seen == [((4, 16), (2, 8, 16), torch.float32, 4)]
    assert attention.checked_kernel(paths, "triton_prefill", module, q, k_pool, 0, 30.0)
    broken = types.SimpleNamespace(chunk_attention=raising)
    other = FastPaths()
    assert not attention.checked_kernel(other, "triton_prefill", broken, q, k_pool, 0, 0.0)
    assert other.facts()["triton_prefill"].startswith("fell back: RuntimeError")
    assert paths.facts() == {"triton_decode": "checked", "triton_prefill": "checked"}


@pytest.mark.parametrize("fault", [None, "replay-differs", "capture-raises"])
def test_cuda_graphs_are_checked_by_one_replay_against_eager(monkeypatch, caplog, reference_tokens, fault):
    monkeypatch.setattr(attention, "_KERNEL", [None])
    stand_in_cuda_graphs(monkeypatch, replay_offset=5.0 if fault == "replay-differs" else 0.0,
                         capture_raises=fault == "capture-raises")
    llm = tiny()
    llm.runner.enable_graphs(8, -(-llm.max_model_len // llm.block_size), capture=True)
    with caplog.at_level(logging.WARNING):
        got = tokens(llm)
    assert got == reference_tokens
    graphs, state = llm.runner.graphs, llm.facts().fast_paths["cuda_graphs"]
    warned = fell_back(caplog, "cuda_graphs")
    if fault is None:
        assert state == "checked" and graphs.replays > 0 and not warned
        return
    assert graphs.failed and len(warned) == 1 and "eager decoding" in warned[0]
    assert state.startswith("fell back: " + ("a replay's logits differ" if fault == "replay-differs"
                                             else "RuntimeError: CUDA error"))


def test_strict_kernels_stops_on_a_graph_that_disagrees(monkeypatch):
    monkeypatch.setattr(attention, "_KERNEL", [None])
    stand_in_cuda_graphs(monkeypatch, replay_offset=5.0)
    llm = tiny(strict_kernels=True)
    llm.runner.enable_graphs(8, -(-llm.max_model_len // llm.block_size), capture=True)
    with pytest.raises(FastPathError, match="cuda_graphs failed its check"):
        tokens(llm)


def test_a_wrong_int8_gemm_falls_back_to_the_dequantized_product(monkeypatch, caplog):
    from engine.quantization.methods import Int8Linear

    model = "builtin:tiny"
    good = LLMEngine(EngineConfig(model=model, quantization="int8", max_num_seqs=8))
    assert good.runner.paths.facts() == {"int8_gemm": "checked"}
    for parent in list(good.runner.model.modules()):  # the reference path, by hand
        for name, child in list(parent.named_children()):
            if isinstance(child, Int8Linear):
                setattr(parent, name, DequantizedLinear(child))
    want = tokens(good)
    forward = Int8Linear.forward
    monkeypatch.setattr(Int8Linear, "forward", lambda self, x: forward(self, x) * 2)  # a kernel off by 2x
    with caplog.at_level(logging.WARNING):
        bad = LLMEngine(EngineConfig(model=model, quantization="int8", max_num_seqs=8))
    assert len(fell_back(caplog, "int8_gemm")) == 1
    assert not any(isinstance(m, Int8Linear) and not isinstance(p, DequantizedLinear)
                   for p in bad.runner.model.modules() for m in p.children())
    assert tokens(bad) == want
    assert bad.facts().fast_paths["int8_gemm"].startswith("fell back: differs from the reference by")


def test_int4_has_no_second_path_so_a_failed_check_refuses_to_start(monkeypatch):
    from engine.quantization.int4 import Int4Linear

    monkeypatch.setattr(Int4Linear, "forward", raising)
    with pytest.raises(FastPathError, match="int4_gemm failed its check .*no reference path"):
        LLMEngine(EngineConfig(model="builtin:tiny", quantization="int4", max_num_seqs=8))


def test_the_report_shows_which_paths_fell_back():
    engine = {"device": "cuda:0", "dtype": "bfloat16", "shards": 2, "rows": 10,
              "fast_paths": {"cuda_graphs": "fell back: RuntimeError: capture; eager decoding instead",
                             "triton_decode": "checked"}}
    table = report_table({"output": "out/", "status": "complete", "shards_committed": 2, "rows": 10, "errors": 0,
                          "prompt_tokens": 100, "generated_tokens": 50, "usage": {}, "engines": [engine]})
    assert "cuda_graphs: fell back: RuntimeError: capture; eager decoding instead" in table
    assert "triton_decode: checked" in table


def test_relative_difference_catches_shapes_and_non_finite_values():
    a = torch.ones(2, 3)
    assert relative_difference(a, a) == 0.0
    assert relative_difference(a, torch.ones(3, 2)) == float("inf")
    assert relative_difference(a * float("nan"), a) == float("inf")
    assert abs(relative_difference(a * 1.01, a) - 0.01) < 1e-6


def test_the_device_bitmask_kernel_is_checked_against_the_byte_bias(monkeypatch):
    """xgrammar's kernel applies masks off the CPU once it agreed with the byte bias on a grammar's
    first step; held here with xgrammar's own kernel on CPU tensors, then a wrong one."""
    xgrammar = pytest.importorskip("xgrammar")
    from engine.structured.bitmask import byte_bias, device_kernel_checked

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 100, generator=gen)
    mask = torch.randint(-2**31, 2**31 - 1, (4, 4), dtype=torch.int32, generator=gen)
    rows = [0, 2, 3]
    before = logits.clone()
    paths = FastPaths()
    assert device_kernel_checked(paths, logits, mask, rows, 100)
    assert paths.facts() == {"structured_bitmask": "checked"}
    masked = logits.clone()
    byte_bias(masked, mask, rows, 100)
    assert torch.isneginf(masked[1]).sum() == 0 and torch.isneginf(masked[0]).sum() > 10
    monkeypatch.setattr(xgrammar, "apply_token_bitmask_inplace", lambda out, m, indices=None: out.fill_(float("-inf")))
    wrong_paths = FastPaths()
    assert not device_kernel_checked(wrong_paths, logits, mask, rows, 100)
    assert wrong_paths.facts()["structured_bitmask"].startswith("fell back: differs")
    assert torch.equal(logits, before)  # the checks worked on copies


def test_a_lora_layer_that_fails_its_check_refuses_to_start(monkeypatch):
    from engine.lora.layers import LoRALinear

    llm = LLMEngine(EngineConfig(model="builtin:tiny", enable_lora=True, max_num_seqs=4))
    assert llm.runner.paths.facts()["lora"] == "checked"
    forward = LoRALinear.forward
    monkeypatch.setattr(LoRALinear, "forward", lambda self, x: forward(self, x) * 1.01)
    with pytest.raises(FastPathError, match=r"lora failed its check \(differs .*\); adapters cannot be served"):
        LLMEngine(EngineConfig(model="builtin:tiny", enable_lora=True, max_num_seqs=4))
