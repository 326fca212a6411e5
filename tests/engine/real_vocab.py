"""A tiny random Llama with a real 32k vocabulary: the SentencePiece tokenizer that the
mistral-common package ships (data/tokenizer.model.v1), converted once by transformers.

Random weights cannot write JSON on their own, and a vocabulary of 32,000 multi-character pieces
(with SentencePiece's "▁" spaces, byte fallback and merged punctuation such as '",') is what a
grammar backend has to get right on real models: the byte tokenizer of builtin:tiny hides all that.
"""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import torch

VOCAB_FILE = "tokenizer.model.v1"
"""The 32k SentencePiece model of Mistral 7B v0.1 inside mistral_common/data."""
VOCAB = 32000


def sentencepiece_file() -> Path:
    """mistral-common's tokenizer.model.v1, found without importing the package (its imports
    pull in much more than a test needs)."""
    spec = importlib.util.find_spec("mistral_common")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the mistral-common package (test extra) is not installed")
    path = Path(spec.origin).parent / "data" / VOCAB_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed mistral-common")
    return path


def build_real_vocab_model(out: Path, seed: int = 0, hidden: int = 64, layers: int = 2) -> Path:
    """Saves a random Llama (hidden `hidden`, `layers` layers) with the 32k tokenizer under `out`."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaTokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    raw = out / "sentencepiece"
    raw.mkdir(exist_ok=True)
    shutil.copyfile(sentencepiece_file(), raw / "tokenizer.model")
    tokenizer = LlamaTokenizer.from_pretrained(raw)  # SentencePiece -> tokenizer.json (a few seconds)
    tokenizer.save_pretrained(out)
    shutil.rmtree(raw)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=None, initializer_range=0.3, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(out, safe_serialization=True)
    return out
