"""Tiny random causal LMs of several architectures, saved as HF directories with a byte tokenizer.

Random models with the default init have nearly flat logits; a larger initializer_range makes
greedy choices clear, so token-for-token parity tests are meaningful.
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, GPT2Config, GPTNeoXConfig,
                          GraniteConfig, LlamaConfig, MistralConfig, MixtralConfig, Olmo2Config, OPTConfig,
                          Phi3Config, Qwen2Config, Qwen3Config, Qwen3MoeConfig)

from engine.models.builtin import byte_tokenizer

VOCAB = 259
ARCHS = ("llama", "qwen2", "gpt2", "gpt_neox", "opt", "mistral", "phi3", "qwen3")
MORE_ARCHS = ("gemma2", "gemma3", "mixtral", "qwen3_moe", "llama3_rope", "phi3_longrope", "olmo2", "granite")
"""Families added with the paged pool: soft-capping, mixed sliding/full layers, MoE, rope scalings."""
LONGROPE_ORIGINAL = 40
"""phi3_longrope's original_max_position_embeddings: parity prompts run on both sides of it."""
SLIDING_WINDOW = 24
"""mistral's window: shorter than the parity prompts + outputs, so the window really cuts."""


def tiny_config(arch: str, init: float = 0.3):
    special = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "llama":
        return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                           initializer_range=init, **special)
    if arch == "qwen2":
        return Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                           initializer_range=init, use_sliding_window=False, **special)
    if arch == "gpt2":
        return GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=512,
                          initializer_range=init, **special)
    if arch == "gpt_neox":
        return GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, max_position_embeddings=512, initializer_range=init,
                             **special)
    if arch == "opt":
        return OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=512, word_embed_proj_dim=64,
                         init_std=init, **special)
    if arch == "mistral":
        return MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                             sliding_window=SLIDING_WINDOW, initializer_range=init, **special)
    if arch == "phi3":
        return Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          original_max_position_embeddings=512, initializer_range=init, **special)
    if arch == "qwen3":
        return Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                           initializer_range=init, **special)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=init, **special)
    if arch == "gemma2":
        return Gemma2Config(**common, head_dim=16, sliding_window=SLIDING_WINDOW, query_pre_attn_scalar=16,
                            attn_logit_softcapping=5.0, final_logit_softcapping=8.0)
    if arch == "gemma3":
        return Gemma3TextConfig(**common, head_dim=16, sliding_window=SLIDING_WINDOW, query_pre_attn_scalar=16,
                                layer_types=["sliding_attention", "full_attention"])
    if arch == "mixtral":
        return MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**common, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                              decoder_sparse_step=1)
    if arch == "llama3_rope":
        return LlamaConfig(**common, rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 64})
    if arch == "phi3_longrope":
        half = 64 // 4 // 2
        return Phi3Config(**{**common, "max_position_embeddings": 512},
                          original_max_position_embeddings=LONGROPE_ORIGINAL,
                          rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                           "short_factor": [1.0 + 0.1 * i for i in range(half)],
                                           "long_factor": [2.0 + 0.5 * i for i in range(half)]})
    if arch == "olmo2":
        return Olmo2Config(**common)
    if arch == "granite":
        return GraniteConfig(**common, attention_multiplier=0.2, residual_multiplier=0.5, embedding_multiplier=2.0,
                             logits_scaling=2.0)
    raise ValueError(arch)


def build_tiny_model(arch: str, out: Path, seed: int = 0, eos_scale: float | None = None, init: float = 0.3) -> Path:
    """Saves a tiny random `arch` model with the byte tokenizer under `out`; returns `out`.

    eos_scale multiplies EOS's row of the output embedding: where the hidden state points its
    way, EOS wins, so greedy rows end by EOS at varied steps (unscaled, they rarely do)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, init))
    if eos_scale is not None:
        with torch.no_grad():
            model.get_output_embeddings().weight[model.config.eos_token_id] *= eos_scale
    model.save_pretrained(out, safe_serialization=True)
    byte_tokenizer().save_pretrained(out)
    return out
