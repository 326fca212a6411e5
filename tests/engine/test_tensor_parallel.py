"""tensor_parallel_size=2 on CPU (gloo): the same tokens and logits as one process, on shards.

Starting ranks costs seconds, so each architecture's pair of engines is built once per module."""
from __future__ import annotations

import multiprocessing
import os

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.api.errors import ModelLoadError
from parity import assert_same_tokens, reference

PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog. " * 3, "abc", "Hello there, and more"]
LOGPROB_TOL = 1e-4
"""Largest difference of a logprob between one process and two (fp32; the all-reduce sums in another order)."""


def config(path, n: int, **kw) -> EngineConfig:
    return EngineConfig(model=str(path), max_batch_tokens=1024, max_num_seqs=8, tensor_parallel_size=n, **kw)


@pytest.fixture(scope="module", params=[("llama", "continuous"), pytest.param(("qwen2", "static"), marks=pytest.mark.slow),
                                        ("phi3", "continuous"), pytest.param(("mistral", "static"), marks=pytest.mark.slow)],
                ids=lambda p: "-".join(p))  # two ranks start per pair: the static pairs are in the slow part
def engines(request, tiny_model_dir):
    """(architecture, TP=1 engine, TP=2 engine, model dir), both engines in the same scheduling
    mode: llama and qwen2 with GQA (qwen2 with Q/K/V biases), phi3 with fused qkv and gate_up
    projections split inside their sections, mistral with a sliding window shorter than the long
    prompt. Prefix caching is on (the default)."""
    arch, mode = request.param
    path = tiny_model_dir(arch)
    one = LLMEngine(config(path, 1, scheduling=mode))
    two = LLMEngine(config(path, 2, scheduling=mode))
    yield arch, one, two, path
    two.close()


def test_greedy_tokens_equal_transformers(engines, reference_model, forgiveness):
    """The shards' tokens against transformers' own greedy generate (one row at a time)."""
    arch, _, two, path = engines
    model = reference_model(path)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    tokenizer = two.tokenizer
    for prompt, ours in zip(PROMPTS, two.generate(PROMPTS, params)):
        ids = tokenizer.encode(prompt)
        ref, scores = reference(model, ids, 16, stop_at_eos=False)
        assert_same_tokens(ours.token_ids, ref, scores, f"{arch} TP=2 {prompt[:12]!r}", forgiveness)


def test_greedy_tokens_and_logprobs_equal_one_process(engines):
    arch, one, two, _ = engines
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=3)
    for a, b in zip(one.generate(PROMPTS, params), two.generate(PROMPTS, params)):
        assert b.token_ids == a.token_ids, arch
        for step_a, step_b in zip(a.logprobs, b.logprobs):
            assert step_a.keys() == step_b.keys(), arch
            assert max(abs(step_a[t] - step_b[t]) for t in step_a) < LOGPROB_TOL, arch


def test_seeded_sampling_equals_one_process(engines):
    arch, one, two, _ = engines
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7 + i) for i in range(len(PROMPTS))]
    assert [c.token_ids for c in two.generate(PROMPTS, params)] == [c.token_ids for c in one.generate(PROMPTS, params)]


def test_choice_scores_equal_one_process(engines):
    """Scoring forks copy a partial prompt block: the copy runs on every rank's pool."""
    arch, one, two, _ = engines
    prompts, choices = ["The answer is", "Pick one of"], [[" yes", " no", " maybe"], [" red", " blue"]]
    for a, b in zip(one.score_choices(prompts, choices), two.score_choices(prompts, choices)):
        assert b.num_tokens == a.num_tokens
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < LOGPROB_TOL * 10


def test_each_rank_holds_its_share_of_the_kv_heads(engines):
    arch, one, two, _ = engines
    two.generate(PROMPTS[:1], SamplingParams(max_tokens=1))
    one.generate(PROMPTS[:1], SamplingParams(max_tokens=1))
    assert two.cache.allocated and one.cache.allocated
    assert two.pool_tokens == one.pool_tokens  # max_batch_tokens stays the pool's tokens
    assert two.cache.nbytes() * 2 == one.cache.nbytes()
    assert two.runner.weights_nbytes < one.runner.weights_nbytes


def test_close_stops_every_rank(engines):
    arch, one, two, _ = engines
    pids = two.runner.ranks.pids
    two.close()
    assert not [p for p in multiprocessing.active_children() if p.pid in pids]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_sizes_that_do_not_divide_are_refused_in_one_line(tiny_model_dir):
    before = set(multiprocessing.active_children())
    with pytest.raises(ModelLoadError) as err:
        LLMEngine(config(tiny_model_dir("llama"), 3))
    message = str(err.value)
    assert message == ("tensor_parallel_size 3 does not divide the model's num_attention_heads 4, "
                       "num_key_value_heads 2 (nor is it a multiple of them: the 2 KV heads are replicated only "
                       "then), intermediate_size 128")
    assert set(multiprocessing.active_children()) <= before  # refused before any rank started


def test_an_architecture_without_a_plan_is_refused_in_one_line(tiny_model_dir):
    before = set(multiprocessing.active_children())
    with pytest.raises(ModelLoadError, match=r"^tensor_parallel_size 2: GPT2LMHeadModel is not supported "
                                             r"\(it has no tensor-parallel plan for its decoder\)$"):
        LLMEngine(config(tiny_model_dir("gpt2"), 2))
    assert set(multiprocessing.active_children()) <= before


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_tensor_parallel_size_is_validated(bad):
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineConfig(tensor_parallel_size=bad)


@pytest.mark.parametrize("bad", [0, -2.0, float("inf"), float("nan"), True, "30"])
def test_distributed_timeout_is_a_finite_positive_number_of_seconds(bad):
    with pytest.raises(ValueError, match="distributed_timeout_s must be a positive number of seconds"):
        EngineConfig(tensor_parallel_size=2, distributed_timeout_s=bad)


def test_a_numbered_cuda_device_is_refused_with_ranks():
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 runs on auto, cpu or cuda"):
        EngineConfig(tensor_parallel_size=2, device="cuda:1")
