"""prompt_logprobs (vLLM's): each prompt token's log-probability given the tokens before it, and
its top-N alternatives, against a teacher-forced transformers forward (log_softmax over the whole
prompt's logits) on a random Llama with a real 32k vocabulary: in both modes, with prefills split
over passes, past a cached prefix, under preemption, with n samples, and through engine.LLM."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.api.config import SCHEDULING_MODES
from real_vocab import build_real_vocab_model

PROMPTS = ["The parcel arrived late but the box was intact and dry",
           "Write a list of fruits:", "Once upon a time in a small town by the sea there lived"]
TOP = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_real_vocab_model(tmp_path_factory.mktemp("prompt_logprobs"))


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference(hf, ids: list[int]) -> torch.Tensor:
    """(len(ids) - 1, V): log_softmax of the logits at positions 0..n-2, which predict tokens 1..n-1."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def check(entries, ids: list[int], ref: torch.Tensor, top: int) -> None:
    assert len(entries) == len(ids) and entries[0] is None
    for p, (entry, token) in enumerate(zip(entries[1:], ids[1:])):
        want = ref[p]
        assert entry[token] == pytest.approx(float(want[token]), abs=1e-4), f"token {p + 1}"
        best = want.topk(top)
        for t, v in zip(best.indices.tolist(), best.values.tolist()):
            assert entry[t] == pytest.approx(v, abs=1e-4), f"top alternative {t} of token {p + 1}"
        assert len(entry) in (top, top + 1)  # the prompt token and its top-N, which may include it


@pytest.mark.parametrize("mode", SCHEDULING_MODES)
def test_prompt_logprobs_match_a_teacher_forced_forward(model_dir, hf, mode):
    # passes of 8 tokens: every prompt's prefill spans passes, beside other rows' prefills and decodes
    llm = LLMEngine(EngineConfig(model=str(model_dir), scheduling=mode, max_num_batched_tokens=8, max_num_seqs=4))
    plain = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=TOP))
    for prompt, out, before in zip(PROMPTS, outs, plain):
        ids = llm.tokenizer.encode(prompt)
        check(out.prompt_logprobs, ids, reference(hf, ids), TOP)
        assert out.token_ids == before.token_ids  # the generated tokens are the same as without them
        assert out.num_cached_tokens == 0  # computed, not taken from the cache the first call filled
        assert before.prompt_logprobs is None


def test_zero_gives_the_prompt_token_only_and_the_cache_serves_others(model_dir, hf):
    llm = LLMEngine(EngineConfig(model=str(model_dir), block_size=4))
    ids = llm.tokenizer.encode(PROMPTS[0])
    first = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, temperature=0))[0]
    again = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0))[0]
    assert [None if e is None else list(e) for e in again.prompt_logprobs] == [None] + [[t] for t in ids[1:]]
    check(again.prompt_logprobs, ids, reference(hf, ids), 0)
    assert again.num_cached_tokens == 0 and again.token_ids == first.token_ids
    later = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, temperature=0))[0]
    assert later.num_cached_tokens > 0  # the blocks it computed were named for others


@pytest.mark.parametrize("mode", SCHEDULING_MODES)
def test_the_sibling_samples_share_the_prompt_the_collecting_sample_computes(model_dir, hf, mode):
    """Of n samples, the one collecting prompt logprobs computes the whole prompt (it takes no
    cached block); the others wait for its blocks rather than compute the prompt again (one did)."""
    llm = LLMEngine(EngineConfig(model=str(model_dir), scheduling=mode, block_size=4))
    prompt = PROMPTS[2]
    params = SamplingParams(max_tokens=4, temperature=0.8, seed=3, n=4, prompt_logprobs=1)
    out = llm.generate([prompt], params)[0]
    ids = llm.tokenizer.encode(prompt)
    full = (len(ids) - 1) // 4 * 4  # the prompt's full blocks (its last token is computed again)
    assert [s.num_cached_tokens for s in out.samples] == [0] + [full] * 3
    assert llm.batch_stats[-1].cached_prompt_tokens == 3 * full
    check(out.prompt_logprobs, ids, reference(hf, ids), 1)
    plain = LLMEngine(EngineConfig(model=str(model_dir), scheduling=mode, block_size=4))
    want = plain.generate([prompt], SamplingParams(max_tokens=4, temperature=0.8, seed=3, n=4))[0]
    assert [s.token_ids for s in out.samples] == [s.token_ids for s in want.samples]


def test_preempted_rows_capped_passes_and_n_samples_keep_one_entry_per_token(model_dir, hf):
    # a pool of 12 blocks of 4 tokens: three rows growing to 40 tokens each preempt one another
    llm = LLMEngine(EngineConfig(model=str(model_dir), scheduling="continuous", block_size=4, max_batch_tokens=48,
                                 max_num_seqs=3))
    llm.scheduler.collect_tokens = 5  # passes keep the logits of 5 prompt tokens at most
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=7, n=2, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate(PROMPTS, params)
    assert sum(b.preemptions for b in llm.batch_stats) > 0
    plain = LLMEngine(EngineConfig(model=str(model_dir), scheduling="continuous", block_size=4, max_batch_tokens=512,
                                   max_num_seqs=3))
    want = plain.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.8, seed=7, n=2, ignore_eos=True))
    for prompt, out, w in zip(PROMPTS, outs, want):
        ids = llm.tokenizer.encode(prompt)
        check(out.prompt_logprobs, ids, reference(hf, ids), 1)
        assert [s.token_ids for s in out.samples] == [s.token_ids for s in w.samples]


def test_bounds_and_the_vllm_face(model_dir):
    llm = LLM(model=str(model_dir), max_logprobs=4)
    bad = llm.llm_engine.generate([PROMPTS[1]], SamplingParams(max_tokens=1, prompt_logprobs=5))[0]
    assert bad.finish_reason == "error" and "prompt_logprobs 5 is above max_logprobs (4" in bad.error
    with pytest.raises(ValueError, match="prompt_logprobs must be >= 0"):
        SamplingParams(prompt_logprobs=-1)
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2))[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    second = out.prompt_logprobs[1]
    ranks = sorted(lp.rank for t, lp in second.items() if lp.rank <= 2)
    assert ranks == [1, 2] and all(isinstance(lp.decoded_token, str) for lp in second.values())
    assert out.outputs[0].logprobs is None
