"""Choice scoring: log-likelihoods equal transformers' own, computed one choice at a time."""
from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine


def reference_logprob(model, prompt_ids: list[int], choice_ids: list[int]) -> float:
    """log P(choice | prompt) from one plain forward pass over prompt + choice."""
    x = torch.tensor([prompt_ids + choice_ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(x).logits[0].float(), dim=-1)
    return sum(float(lp[len(prompt_ids) - 1 + j, t]) for j, t in enumerate(choice_ids))


@pytest.mark.parametrize("arch", ["llama", "gpt2", "mistral", "gemma2"])
@pytest.mark.parametrize("budget", [4096, 100])
def test_choice_logprobs_match_transformers(arch, budget, tiny_model_dir, reference_model):
    """Prompts of different lengths in one group, choices of 1-9 tokens, and (budget 100) rows
    split over several groups: every score equals the independent computation. mistral and
    gemma2 have a 24-token window, shorter than the first prompt and its choices."""
    path = tiny_model_dir(arch)
    ref = reference_model(path)
    llm = LLMEngine(EngineConfig(model=str(path), max_batch_tokens=budget))
    prompts = ["The film was wonderful. Sentiment:", "Awful.", "Q: 2+2? A:"]
    choices = [[" positive", " negative"], [" good", " bad", " neutral-ish"], [" 4", " four", " 5"]]
    scores = llm.score_choices(prompts, choices)
    for p, cs, sc in zip(prompts, choices, scores):
        assert sc.error is None
        pids = llm.tokenizer.encode(p)
        expected = [reference_logprob(ref, pids, llm.tokenizer.encode_continuation(c)) for c in cs]
        assert sc.logprobs == pytest.approx(expected, abs=1e-4)
        assert sc.num_tokens == [len(llm.tokenizer.encode_continuation(c)) for c in cs]
        assert sc.num_prompt_tokens == len(pids)
        assert max(range(len(cs)), key=sc.logprobs.__getitem__) == max(range(len(cs)), key=expected.__getitem__)


def test_single_token_choices_and_token_id_inputs():
    llm = LLMEngine(EngineConfig(model="builtin:tiny"))
    ids = llm.tokenizer.encode("pick one:")
    by_text = llm.score_choices(["pick one:"], [["a", "b"]])[0]  # one byte token each
    by_ids = llm.score_choices([ids], [[llm.tokenizer.encode_continuation("a"), llm.tokenizer.encode_continuation("b")]])[0]
    assert by_text.logprobs == pytest.approx(by_ids.logprobs, abs=1e-5)
    assert by_text.num_tokens == [1, 1]


def test_rows_that_cannot_be_scored_fail_alone():
    llm = LLMEngine(EngineConfig(model="builtin:tiny", max_batch_tokens=64, max_model_len=48))
    out = llm.score_choices(["ok", "", "x" * 40, "fine", "many"],
                            [[" y", " n"], [" y"], [" y" * 5], [" y", ""], [" a"] * 40])
    assert out[0].error is None and len(out[0].logprobs) == 2
    assert "empty prompt" in out[1].error
    assert "max_model_len (48)" in out[2].error
    assert "non-empty" in out[3].error
    assert "max_batch_tokens (64)" in out[4].error


def test_a_row_needs_its_prompt_blocks_once_and_per_longer_choice_a_partial_copy():
    from engine.core.block_pool import BlockPool
    from engine.choice_scoring import _blocks

    pool = BlockPool(num_blocks=64, block_size=16)
    assert _blocks(pool, [1] * 40, [[2], [3]]) == 3  # one-token choices are scored from the prompt's logits
    assert _blocks(pool, [1] * 40, [[2] * 40, [3]]) == 3 + 3  # 8 tokens of the partial block + 40


def test_second_pass_in_row_chunks_gives_the_same_scores(monkeypatch):
    import engine.choice_scoring

    llm = LLMEngine(EngineConfig(model="builtin:tiny"))
    prompts, choices = ["one two", "three"], [[" alpha", " beta", " gamma delta"], [" x y z", " w"]]
    whole = llm.score_choices(prompts, choices)
    monkeypatch.setattr(engine.choice_scoring, "LOGITS_BYTES", 1)  # one choice row per forward pass
    chunked = llm.score_choices(prompts, choices)
    for a, b in zip(whole, chunked):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_a_shared_prompt_whose_prefill_spans_passes_is_computed_once():
    """Two rows with one 60-token prompt, 16 tokens a pass: the second waits for the first's
    blocks through all four passes of its prefill instead of computing them itself."""
    llm = LLMEngine(EngineConfig(model="builtin:tiny", block_size=8, max_num_batched_tokens=16))
    computed, run = [], llm.runner.run
    llm.runner.run = lambda cache, chunks, **kw: (computed.append(sum(c.count for c in chunks)), run(cache, chunks, **kw))[1]
    prompt = list(range(1, 61))
    scores = llm.score_choices([prompt, prompt], [[[5]], [[6]]])
    assert sum(computed) == 60 + 4  # the second row computes only its last, partial block
    assert [s.num_cached_tokens for s in scores] == [0, 56]
