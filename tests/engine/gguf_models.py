"""Tiny GGUF files written from tiny Hugging Face models, as llama.cpp's converter writes them:
gguf-py's tensor names, Llama's Q/K rows permuted, Gemma's norms stored as w + 1, each tensor in
a chosen ggml type (quantized by gguf-py), the model's metadata under transformers' GGUF key map,
and the byte tokenizer as a `gpt2` vocabulary."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_models import build_tiny_model

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
             "gemma3": "gemma3", "phi3": "phi3"}
"""Our family name -> the GGUF architecture llama.cpp writes for it (Mistral's says llama)."""
TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
"""What gguf-py quantizes: the 2-D weights of a file cycle through them."""


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row order (the inverse of transformers' reverse permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(family: str, out: Path, *, types=TYPES, tokenizer: bool = True, drop: tuple[str, ...] = (),
               seed: int = 0) -> tuple[Path, Path]:
    """(the .gguf file, the Hugging Face directory it was written from) for a tiny `family` model."""
    import gguf
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    hf_dir = build_tiny_model(family, out / f"{family}-hf", seed=seed)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    config = model.config
    arch = GGUF_ARCH[family]
    path = out / f"{family}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("mistral" if family == "mistral" else f"tiny-{family}")  # transformers' test for Mistral
    keys = GGUF_CONFIG_MAPPING["mistral" if family == "mistral" else arch]
    for key, attr in keys.items():
        value = getattr(config, attr, None) if attr else None
        if attr == "head_dim" and value is None:
            value = config.hidden_size // config.num_attention_heads
        if value is None or isinstance(value, (list, dict)):
            continue
        full = f"{arch}.{key}"
        if isinstance(value, float):
            writer.add_float32(full, value)
        else:
            writer.add_uint32(full, int(value))
    if arch == "qwen3":  # llama.cpp writes the head width; transformers' key map leaves it out
        writer.add_uint32(f"{arch}.attention.key_length", config.head_dim)
        writer.add_uint32(f"{arch}.attention.value_length", config.head_dim)
    if tokenizer:
        tok = AutoTokenizer.from_pretrained(hf_dir)
        vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list([t for t, _ in vocab])
        writer.add_token_types([3 if t in tok.all_special_tokens else 1 for t, _ in vocab])
        writer.add_token_scores([0.0] * len(vocab))  # no merges: transformers derives none from the scores
        writer.add_bos_token_id(tok.bos_token_id)
        writer.add_eos_token_id(tok.eos_token_id)
        writer.add_pad_token_id(tok.pad_token_id)
        writer.add_add_bos_token(True)
        writer.add_chat_template(tok.chat_template)
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch),
                                     config.num_hidden_layers)
    state = model.state_dict()
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    step = 0
    for name, tensor in state.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, _, suffix = name.rpartition(".")
        gguf_name = names.get_name(base)
        assert gguf_name is not None, name
        gguf_name = f"{gguf_name}.{suffix}"
        if gguf_name in drop:
            continue
        w = tensor.numpy().astype(np.float32)
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            w = _permute(w, heads if "attn_q" in gguf_name else kv_heads)
        if arch in ("gemma2", "gemma3") and "norm.weight" in gguf_name:
            w = w + 1
        kind = gguf.GGMLQuantizationType[types[step % len(types)]] if w.ndim == 2 else gguf.GGMLQuantizationType.F32
        step += w.ndim == 2
        data = gguf.quants.quantize(w, kind)
        writer.add_tensor(gguf_name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, hf_dir
