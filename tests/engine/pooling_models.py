"""Tiny random pooling models (encoders, decoder embedders, classifiers, a cross-encoder), saved
as Hugging Face and sentence-transformers directories with a real WordPiece tokenizer."""
from __future__ import annotations

import json
import random
import string
from pathlib import Path

import torch
from transformers import (AutoModel, AutoModelForSequenceClassification, BertConfig, BertTokenizerFast,
                          ModernBertConfig, Qwen2Config, Qwen3Config, RobertaConfig, XLMRobertaConfig)

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
LETTERS = string.ascii_lowercase
WORDS = ["the", "a", "of", "and", "to", "in", "is", "it", "that", "for", "on", "with", "as", "was", "at", "by"]
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def vocabulary() -> list[str]:
    return SPECIAL + WORDS + list(LETTERS) + ["##" + c for c in LETTERS] + list(".,!?")


def write_tokenizer(path: Path) -> BertTokenizerFast:
    path.mkdir(parents=True, exist_ok=True)
    tok = BertTokenizerFast(vocab={t: i for i, t in enumerate(vocabulary())}, model_max_length=512)
    tok.save_pretrained(path)
    return tok


def texts(n: int, seed: int = 0, lo: int = 1, hi: int = 500) -> list[str]:
    """n texts of about lo..hi tokens (WordPiece: a made-up word is about one token per letter)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        target, words, count = rng.randint(lo, hi), [], 0
        while count < target:
            w = rng.choice(WORDS) if rng.random() < 0.4 else "".join(rng.choices(LETTERS, k=rng.randint(1, 6)))
            words.append(w)
            count += 1 if w in WORDS else len(w)
        out.append(" ".join(words))
    return out


def encoder_config(kind: str, **extra):
    v = len(vocabulary())
    common = dict(vocab_size=v, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  **extra)
    if kind == "bert":
        return BertConfig(max_position_embeddings=512, **common)
    if kind == "roberta":
        return RobertaConfig(max_position_embeddings=514, pad_token_id=0, **common)
    if kind == "xlm-roberta":
        return XLMRobertaConfig(max_position_embeddings=514, pad_token_id=0, **common)
    if kind == "modernbert":
        return ModernBertConfig(max_position_embeddings=512, local_attention=16, global_attn_every_n_layers=2,
                                pad_token_id=0, cls_token_id=2, sep_token_id=3, bos_token_id=2, eos_token_id=3,
                                **common)
    raise ValueError(kind)


def decoder_config(kind: str, **extra):
    common = dict(vocab_size=len(vocabulary()), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0,
                  bos_token_id=2, eos_token_id=3, **extra)
    if kind == "qwen3":
        return Qwen3Config(head_dim=8, **common)
    return Qwen2Config(use_sliding_window=False, **common)


def build_encoder(path: Path, kind: str = "bert", seed: int = 0) -> Path:
    """A plain encoder directory (AutoModel weights and the tokenizer)."""
    torch.manual_seed(seed)
    AutoModel.from_config(encoder_config(kind)).save_pretrained(path)
    write_tokenizer(path)
    return path


def build_decoder_embedder(path: Path, seed: int = 0) -> Path:
    """A Qwen3-shaped decoder body (Qwen3Model weights), as Qwen3-Embedding is saved."""
    torch.manual_seed(seed)
    AutoModel.from_config(decoder_config("qwen3")).save_pretrained(path)
    write_tokenizer(path)
    return path


def build_sentence_transformer(path: Path, base: Path, pooling: str, normalize: bool = True) -> Path:
    """A sentence-transformers directory over `base`: Transformer, Pooling(pooling), Normalize."""
    from sentence_transformers import SentenceTransformer, models

    transformer = models.Transformer(str(base))
    modules = [transformer, models.Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling)]
    if normalize:
        modules.append(models.Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(path))
    write_tokenizer(path)  # the tokenizer files beside the weights, as Hub models ship them
    return path


def build_classifier(path: Path, kind: str = "bert", num_labels: int = 3, seed: int = 0) -> Path:
    """A *ForSequenceClassification directory (num_labels 1: a cross-encoder)."""
    torch.manual_seed(seed)
    labels = {"id2label": LABELS, "label2id": {v: k for k, v in LABELS.items()}} if num_labels == 3 else {}
    config = (decoder_config(kind, num_labels=num_labels, **labels) if kind in ("qwen2", "qwen3")
              else encoder_config(kind, num_labels=num_labels, **labels))
    model = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():  # random heads start near zero: spread the logits so the checks see them
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    model.save_pretrained(path)
    write_tokenizer(path)
    return path


def set_config(path: Path, **values) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(values)
    (path / "config.json").write_text(json.dumps(cfg))
