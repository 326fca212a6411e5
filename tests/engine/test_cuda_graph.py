"""The decode graphs' static-buffer passes, checked on CPU: `capture=False` runs exactly the
padded pass a graph replays (static inputs, rows padded to the bucket onto the spare block,
block tables as wide as max_model_len allows), eagerly. Capture and replay themselves run only
on CUDA (tests/engine/test_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.runner.cuda_graph import bucket_sizes, graphs_supported

PROMPTS = ["Hello there", "The quick brown fox", "abc", "A longer prompt that spans a few blocks of the pool",
           "x", "Once upon a time"]


def test_buckets_cover_every_row_count_up_to_the_limit():
    assert bucket_sizes(8) == [1, 2, 4, 8]
    assert bucket_sizes(256)[:8] == [1, 2, 4, 8, 16, 24, 32, 48] and bucket_sizes(256)[-1] == 256
    assert bucket_sizes(100)[-1] == 100 and all(a < b for a, b in zip(bucket_sizes(300), bucket_sizes(300)[1:]))


@pytest.mark.parametrize("mode", ["static", "continuous"])
def test_padded_static_buffer_decode_equals_the_plain_pass(mode):
    config = EngineConfig(model="builtin:tiny", max_batch_tokens=1024, max_num_seqs=8, block_size=8,
                          scheduling=mode)
    plain, graphed = LLMEngine(config), LLMEngine(config)
    graphed.runner.enable_graphs(8, -(-graphed.max_model_len // graphed.block_size), capture=False)
    params = [SamplingParams(max_tokens=10 + 3 * i, temperature=0.9 if i % 2 else 0.0, seed=i, ignore_eos=True,
                             logprobs=2 if i % 3 == 0 else None) for i in range(len(PROMPTS))]
    want = plain.generate(PROMPTS, params)
    graphed.generate(["warm"], SamplingParams(max_tokens=1))  # allocates the pool
    with torch.inference_mode():  # padding must write only here, and nothing may read it
        for layer in graphed.cache.layers:
            layer.keys[graphed.cache.scratch_block] = float("nan")
            layer.values[graphed.cache.scratch_block] = float("nan")
    got = graphed.generate(PROMPTS, params)
    graphs = graphed.runner.graphs
    assert graphs.replays > 0 and graphs.captures == 0  # decode passes ran from the static buffers
    for a, b in zip(want, got):
        assert b.token_ids == a.token_ids
        for step_a, step_b in zip(a.logprobs or [], b.logprobs or []):
            assert step_a.keys() == step_b.keys()
            assert max(abs(step_a[t] - step_b[t]) for t in step_a) < 1e-4
    # 6 rows run in the bucket of 8 (and fewer, as rows end, in 4 or 8): padding rows wrote their
    # one position in the spare block
    scratch = graphed.cache.layers[0].keys[graphed.cache.scratch_block]
    assert not scratch[:, 0].isnan().any() and scratch[:, 1:].isnan().all()
    assert graphed.pool.num_free == graphed.pool.num_blocks  # the spare block is no block of the pool


def test_only_decode_passes_that_sample_every_row_are_eligible():
    llm = LLMEngine(EngineConfig(model="builtin:tiny", max_batch_tokens=1024, max_num_seqs=4, block_size=8))
    llm.runner.enable_graphs(4, 64, capture=False)
    graphs = llm.runner.graphs
    seen = []
    original = graphs.eligible

    def spy(inputs):
        seen.append((len(inputs.tokens), original(inputs)))
        return seen[-1][1]

    graphs.eligible = spy
    llm.generate(["a prompt of some length", "b"], SamplingParams(max_tokens=3, temperature=0))
    prefill, *decode = seen
    assert prefill == (len("a prompt of some length") + 1 + 2, False)  # the prompts' pass (+ BOS each)
    assert decode and all(ok for _, ok in decode)


def test_each_bucket_runs_once_outside_a_capture_before_its_capture(monkeypatch):
    """On CUDA no kernel may be loaded while a stream is captured, and the Triton variant a
    decode pass launches depends on its bucket's rows (split-KV or not, its segment count). So
    every bucket's pass runs once before its capture, not only the first bucket's: checked here
    with stand-ins for the CUDA graph calls, replays running the captured pass."""
    from graph_stand_ins import stand_in_cuda_graphs

    state = stand_in_cuda_graphs(monkeypatch)
    config = EngineConfig(model="builtin:tiny", max_batch_tokens=1024, max_num_seqs=8, block_size=8,
                          scheduling="continuous")
    params = [SamplingParams(max_tokens=3 + 4 * i, temperature=0, ignore_eos=True) for i in range(len(PROMPTS))]
    want = [o.token_ids for o in LLMEngine(config).generate(PROMPTS, params)]
    llm = LLMEngine(config)
    llm.runner.enable_graphs(8, -(-llm.max_model_len // llm.block_size), capture=True)
    got = [o.token_ids for o in llm.generate(PROMPTS, params)]
    graphs = llm.runner.graphs
    assert not graphs.failed and len(graphs.graphs) >= 3  # rows drained 6 -> 1 through buckets 8, 4, 2, 1
    assert state["cold_in_capture"] == []
    assert got == want


def test_dynamic_rotary_scaling_keeps_decode_eager(tmp_path, monkeypatch, tiny_model_dir):
    """transformers' dynamic rope compares the pass's largest position with its cached length on
    the host every forward, which a capture cannot hold: such models decode eagerly instead of
    failing a capture (and warning) on every run. Other models keep their graphs."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from engine.models.builtin import byte_tokenizer

    config = LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    dynamic = LLMEngine(EngineConfig(model=str(tmp_path))).runner
    plain = LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")))).runner
    for runner in (dynamic, plain):
        monkeypatch.setattr(runner, "device", torch.device("cuda"))  # only the check runs: nothing is allocated
    assert not graphs_supported(dynamic) and graphs_supported(plain)
