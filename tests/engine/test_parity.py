"""Greedy output equals transformers generate() (batch size 1, float32), token for token, on
tiny random models of several architectures, for every batch budget and both scheduling modes."""
from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.api.config import SCHEDULING_MODES
from parity import assert_same_tokens, reference
from tiny_models import ARCHS

__all__ = ["PROMPTS", "assert_same_tokens", "reference"]  # test_gpu and test_prefix_cache import them from here

PROMPTS = ["Hello world", "a", "The quick brown fox jumps over the lazy dog",
           "Ünïcödé tèxt — with multi-byte characters ✓", "0123456789" * 6, "short one"]
# (max_batch_tokens, max_num_seqs): one row per batch, a tight token budget, a few rows, all in one batch
BUDGETS = [(4096, 1), (100, 64), (220, 3), (4096, 64)]
EOS_SCALE = {"llama": 1.5, "gpt2": 3.0}
"""The EOS test's models: EOS's output row scaled so that about half the greedy rows end by EOS
(see tiny_models; unscaled, none of these prompts does)."""


@pytest.mark.parametrize("mode", SCHEDULING_MODES)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_for_every_budget(arch, mode, tiny_model_dir, reference_model, forgiveness):
    path = tiny_model_dir(arch)
    ref_model = reference_model(path)
    max_new = 24
    expected = None
    for budget, rows in BUDGETS:
        llm = LLMEngine(EngineConfig(model=str(path), max_batch_tokens=budget, max_num_seqs=rows, scheduling=mode))
        # different max_tokens per row, so rows finish (and, in continuous mode, are replaced) at different steps
        params = [SamplingParams(max_tokens=max_new - 3 * (i % 3), temperature=0, ignore_eos=True)
                  for i in range(len(PROMPTS))]
        outs = llm.generate(PROMPTS, params)
        if expected is None:
            expected = [reference(ref_model, llm.tokenizer.encode(p), max_new, stop_at_eos=False)
                        for p in PROMPTS]
        for p, sp, out, (ref, logits) in zip(PROMPTS, params, outs, expected):
            assert out.finish_reason == "length" and out.error is None
            assert_same_tokens(out.token_ids, ref[: sp.max_tokens], logits, f"{arch} {mode} budget={budget} "
                               f"prompt={p[:12]!r}", forgiveness)
        assert all(s.reserved_tokens <= budget and s.peak_rows <= rows for s in llm.batch_stats)
        if mode == "static" and rows == 1:
            assert len(llm.batch_stats) == len(PROMPTS)
        if budget == 4096 and rows == 64 or mode == "continuous":
            assert len(llm.batch_stats) == 1 and llm.batch_stats[0].rows == len(PROMPTS)


@pytest.mark.parametrize("mode", SCHEDULING_MODES)
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_stops_at_eos_like_transformers(arch, mode, tiny_model_dir, reference_model, forgiveness):
    """Rows end by EOS where transformers' do (EOS kept as the last token id, not in the text);
    the others run to max_tokens. The model makes EOS likely, so both kinds of row occur."""
    path = tiny_model_dir(arch, eos_scale=EOS_SCALE[arch])
    ref_model = reference_model(path)
    llm = LLMEngine(EngineConfig(model=str(path), max_batch_tokens=400, scheduling=mode))
    eos = ref_model.config.eos_token_id
    prompts = [f"prompt number {i}: " + "x" * i for i in range(12)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0))
    finished = []
    for p, out in zip(prompts, outs):
        ref, logits = reference(ref_model, llm.tokenizer.encode(p), 40, stop_at_eos=True)
        if assert_same_tokens(out.token_ids, ref, logits, f"{arch} {p!r}", forgiveness):
            continue
        expected = "stop" if ref[-1] == eos else "length"
        assert out.finish_reason == expected, f"{p!r}: {out.finish_reason}, transformers: {expected}"
        if expected == "stop":
            assert out.token_ids[-1] == eos and "</s>" not in out.text
        finished.append(expected)
    assert "stop" in finished and "length" in finished, finished
    assert outs[0].num_prompt_tokens == len(llm.tokenizer.encode(prompts[0]))


@pytest.mark.parametrize("mode", SCHEDULING_MODES)
def test_penalties_and_min_tokens_match_transformers(mode, tiny_model_dir, reference_model, forgiveness):
    """repetition_penalty and min_tokens use transformers' semantics (prompt+output; EOS masked).
    A near-tie is judged on the penalised scores transformers chose from."""
    path = tiny_model_dir("llama")
    ref_model = reference_model(path)
    llm = LLMEngine(EngineConfig(model=str(path), scheduling=mode))
    prompts = ["aaaa bbbb aaaa", "repeat repeat repeat"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.8,
                                                min_tokens=10))
    for p, out in zip(prompts, outs):
        ref, logits = reference(ref_model, llm.tokenizer.encode(p), 20, stop_at_eos=True,
                                repetition_penalty=1.8, min_new_tokens=10)
        assert_same_tokens(out.token_ids, ref, logits, f"penalty {p!r}", forgiveness)
        assert len(out.token_ids) >= 10
