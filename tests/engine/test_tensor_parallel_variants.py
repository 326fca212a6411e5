"""tensor_parallel_size=2 on CPU over model variants, each test with engines of its own: one KV
head replicated over the ranks, tied embeddings, int8 weights. Apart from test_tensor_parallel.py,
whose module-scoped pairs of engines hold the process's one tensor-parallel engine while its
module runs (a slow share or -k may order any test beside them)."""
from __future__ import annotations

import pytest
import torch

from engine import LLMEngine, SamplingParams
from engine.api.errors import ModelLoadError
from test_tensor_parallel import LOGPROB_TOL, PROMPTS, config


def one_kv_head(arch: str, out, kv: int = 1, heads: int = 4):
    """A tiny `arch` model with `kv` KV heads (Gemma 2B and Gemma 3 1B have one)."""
    from transformers import AutoModelForCausalLM

    from engine.models.builtin import byte_tokenizer
    from tiny_models import tiny_config

    cfg = tiny_config(arch)
    cfg.hidden_size = 16 * heads
    cfg.num_key_value_heads, cfg.num_attention_heads = kv, heads
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    byte_tokenizer().save_pretrained(out)
    return out


@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen2", marks=pytest.mark.slow),
                                  pytest.param("phi3", marks=pytest.mark.slow)])
def test_fewer_kv_heads_than_ranks_are_replicated(arch, tmp_path):
    """One KV head over two ranks: each rank keeps it (its query heads all use it), so the tokens
    and logprobs are one process's. Qwen2's K and V biases and Phi-3's fused qkv_proj are cut the
    same way."""
    path = one_kv_head(arch, tmp_path)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    one = LLMEngine(config(path, 1))
    want = one.generate(PROMPTS, params)
    with LLMEngine(config(path, 2)) as two:
        outs = two.generate(PROMPTS, params)
        assert two.runner.model.config.num_key_value_heads == 1
        assert two.cache.nbytes() == one.cache.nbytes()  # each rank holds the one head of every token
    for a, b in zip(want, outs):
        assert b.token_ids == a.token_ids, arch
        for step_a, step_b in zip(a.logprobs, b.logprobs):
            assert max(abs(step_a[t] - step_b[t]) for t in step_a) < LOGPROB_TOL, arch


def test_kv_heads_that_neither_divide_nor_are_divided_by_the_ranks_are_refused(tmp_path):
    path = one_kv_head("llama", tmp_path, kv=3, heads=6)
    with pytest.raises(ModelLoadError, match=r"^tensor_parallel_size 2 does not divide the model's "
                                             r"num_key_value_heads 3$"):
        LLMEngine(config(path, 2))
    with pytest.raises(ModelLoadError, match=r"num_key_value_heads 3 \(nor is it a multiple of them: the 3 KV "
                                             r"heads are replicated only then\)"):
        LLMEngine(config(path, 4))


def test_a_model_with_tied_embeddings_gives_one_process_tokens_and_logprobs(tiny_model_dir):
    """Gemma 2 ties its head to the input embedding, so the checkpoint stores it once: rank 0's
    head must be that embedding (it was left unset, and every row came out one repeated token)."""
    path = tiny_model_dir("gemma2")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    one = LLMEngine(config(path, 1)).generate(PROMPTS, params)
    with LLMEngine(config(path, 2)) as two:
        outs = two.generate(PROMPTS, params)
    for a, b in zip(one, outs):
        assert b.token_ids == a.token_ids
        for step_a, step_b in zip(a.logprobs, b.logprobs):
            assert max(abs(step_a[t] - step_b[t]) for t in step_a) < LOGPROB_TOL


def test_int8_weights_load_and_run_on_shards(tiny_model_dir):
    """quantization int8 with two ranks: each rank quantizes its shard (rank 1 has no head to
    quantize; it failed at load). Its rows are int8's, not one process's: other scales."""
    path = tiny_model_dir("llama")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    full = LLMEngine(config(path, 1)).generate(PROMPTS, params)
    with LLMEngine(config(path, 2, quantization="int8")) as two:
        assert two.memory["quantization"] == "int8" and two.memory["streamed"]  # each slice quantized as read
        assert two.memory["weights_bytes"] < two.memory["unquantized_weights_bytes"]
        outs = two.generate(PROMPTS, params)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 8 for o in outs)
    # int8 stays close to the float model: the first greedy token is the same
    for a, b in zip(full, outs):
        assert b.token_ids[0] == a.token_ids[0]
