"""Families the paged pool brought in (Gemma 2 and 3, Mixtral, Qwen3-MoE, Llama 3 rope, Phi-3
longrope, OLMo 2, Granite): greedy output equals transformers at batch size 1, in both modes,
with a roomy pool and with one so small that rows are preempted and recomputed."""
from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.api.config import SCHEDULING_MODES
from engine.api.errors import ModelLoadError
from parity import assert_same_tokens, reference
from test_parity import PROMPTS
from tiny_models import LONGROPE_ORIGINAL, MORE_ARCHS

BUDGETS = [(2048, 8), (160, 6)]
"""(max_batch_tokens, max_num_seqs): everything at once; and 10 blocks for 6 rows of up to 85 tokens."""


@pytest.mark.parametrize("mode", SCHEDULING_MODES)
@pytest.mark.parametrize("arch", MORE_ARCHS)
def test_greedy_matches_transformers_with_and_without_preemption(arch, mode, tiny_model_dir, reference_model,
                                                                 forgiveness):
    path = tiny_model_dir(arch)
    ref_model = reference_model(path)
    expected = None
    preempted = 0
    for budget, rows in BUDGETS:
        llm = LLMEngine(EngineConfig(model=str(path), max_batch_tokens=budget, max_num_seqs=rows, scheduling=mode))
        params = [SamplingParams(max_tokens=24 - 3 * (i % 3), temperature=0, ignore_eos=True)
                  for i in range(len(PROMPTS))]
        outs = llm.generate(PROMPTS, params)
        if expected is None:
            expected = [reference(ref_model, llm.tokenizer.encode(p), 24, stop_at_eos=False) for p in PROMPTS]
        for p, sp, out, (ref, logits) in zip(PROMPTS, params, outs, expected):
            assert out.finish_reason == "length" and out.error is None
            assert_same_tokens(out.token_ids, ref[: sp.max_tokens], logits,
                               f"{arch} {mode} budget={budget} prompt={p[:12]!r}", forgiveness)
        preempted += sum(s.preemptions for s in llm.batch_stats)
    assert preempted > 0, "the small pool never preempted: the test does not cover recompute"
    if arch == "phi3_longrope":  # rows on both sides of the switch to the long factors shared passes
        lengths = [len(llm.tokenizer.encode(p)) for p in PROMPTS]
        assert min(lengths) < LONGROPE_ORIGINAL < max(lengths)


def test_architectures_the_engine_cannot_run_fail_at_load_in_one_line(tmp_path):
    from transformers import AutoModelForCausalLM, BloomConfig

    from engine.models.builtin import byte_tokenizer

    AutoModelForCausalLM.from_config(BloomConfig(vocab_size=259, hidden_size=32, n_layer=1, n_head=2)).save_pretrained(
        tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as err:
        LLMEngine(EngineConfig(model=str(tmp_path)))
    assert "BloomForCausalLM" in str(err.value) and "ALiBi" in str(err.value) and "\n" not in str(err.value)


def test_an_attention_implementation_in_extra_is_refused(tiny_model_dir):
    with pytest.raises(ModelLoadError, match="attn_implementation='sdpa' cannot be used"):
        LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), extra={"attn_implementation": "sdpa"}))


def test_a_longrope_row_preempted_past_the_switch_recomputes_with_the_factors_it_had(tiny_model_dir):
    """Three 30-token prompts grow past LongRoPE's switch (40 tokens) and outgrow a 160-token
    pool: the row preempted after the switch recomputes its first 40 positions with the short
    factors they were computed with, not the long ones its length now calls for."""
    path = tiny_model_dir("phi3_longrope")
    prompts = [list(range(3 + 60 * i, 33 + 60 * i)) for i in range(3)]
    assert all(len(p) < LONGROPE_ORIGINAL < len(p) + 40 for p in prompts)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    roomy = LLMEngine(EngineConfig(model=str(path), max_batch_tokens=2048, scheduling="continuous"))
    tight = LLMEngine(EngineConfig(model=str(path), max_batch_tokens=160, scheduling="continuous"))
    want = [o.token_ids for o in roomy.generate(prompts, params)]
    got = [o.token_ids for o in tight.generate(prompts, params)]
    assert sum(s.preemptions for s in tight.batch_stats) > 0
    assert got == want


def test_longrope_prompts_on_either_side_of_the_switch_share_no_cached_blocks(tiny_model_dir):
    """A prompt longer than the switch computes its keys with the long factors from the first
    position, so it cannot reuse a shorter prompt's blocks (short factors) even where its tokens
    start the same: its tokens equal caching off, and prompts on the same side still share."""
    path = tiny_model_dir("phi3_longrope")
    short = list(range(3, 35))  # 32 tokens: short factors
    long = short + list(range(100, 120))  # 52 tokens: long factors
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    results = {}
    for caching in (False, True):
        llm = LLMEngine(EngineConfig(model=str(path), enable_prefix_caching=caching))
        llm.generate([short], params)
        results[caching] = llm.generate([long], params)[0]
        if caching:
            assert results[caching].num_cached_tokens == 0
            again = llm.generate([long + [7]], params)[0]
            assert again.num_cached_tokens == 48  # a long prompt's blocks serve a long prompt
    assert results[True].token_ids == results[False].token_ids
