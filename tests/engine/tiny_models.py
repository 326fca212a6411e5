"""Tiny random causal LMs of several architectures, saved as HF directories with a byte tokenizer.

Random models with the default init have nearly flat logits; a larger initializer_range makes
greedy choices clear, so token-for-token parity tests are meaningful.
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import (GPT2Config, GPTNeoXConfig, LlamaConfig, MistralConfig, OPTConfig, Phi3Config,
                          Qwen2Config, Qwen3Config, AutoModelForCausalLM)

from engine.builtin import byte_tokenizer

VOCAB = 259
ARCHS = ("llama", "qwen2", "gpt2", "gpt_neox", "opt", "mistral", "phi3", "qwen3")
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
    raise ValueError(arch)


def build_tiny_model(arch: str, out: Path, seed: int = 0, eos_scale: float | None = None) -> Path:
    """Saves a tiny random `arch` model with the byte tokenizer under `out`; returns `out`.

    eos_scale multiplies EOS's row of the output embedding: where the hidden state points its
    way, EOS wins, so greedy rows end by EOS at varied steps (unscaled, they rarely do)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch))
    if eos_scale is not None:
        with torch.no_grad():
            model.get_output_embeddings().weight[model.config.eos_token_id] *= eos_scale
    model.save_pretrained(out, safe_serialization=True)
    byte_tokenizer().save_pretrained(out)
    return out
