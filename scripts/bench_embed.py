"""Embedding throughput: the engine's embed() against SentenceTransformer.encode(batch_size=32),
side by side in one run, on random models built here (no download), fp32 on CPU (bf16 on CUDA).

    .venv/bin/python scripts/bench_embed.py [--texts 2000] [--model bert|qwen3|both|minilm] [--budget N]

`--model minilm`: the real builtin:all-minilm-l6-v2 (its wheel's directory, both sides) over real
sentences: the model card's, the shipped configs' data and the tests' data, cycled to --texts.

Models: a 6-layer BERT-base-shaped encoder (hidden 768, 12 heads) with mean pooling + Normalize,
and a Qwen3-shaped decoder embedder (6 layers, hidden 768) with last-token pooling + Normalize,
as sentence-transformers directories. Texts of 8-512 tokens (a WordPiece vocabulary of letters).
Prints rows/s of each, their ratio, and the least cosine between the two sides' rows."""
from __future__ import annotations

import argparse
import json
import random
import string
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

LETTERS = string.ascii_lowercase


def tokenizer(path: Path):
    from transformers import BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list(LETTERS) + ["##" + c for c in LETTERS]
    tok = BertTokenizerFast(vocab={t: i for i, t in enumerate(vocab)}, model_max_length=512)
    tok.save_pretrained(path)
    return len(vocab)


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        target, words, count = rng.randint(6, 505), [], 0
        while count < target:
            w = "".join(rng.choices(LETTERS, k=min(rng.randint(1, 6), max(1, target - count))))
            words.append(w)
            count += len(w)
        out.append(" ".join(words))
    return out


def build(kind: str, root: Path) -> Path:
    from sentence_transformers import SentenceTransformer, models
    from transformers import AutoModel, BertConfig, Qwen3Config

    base = root / f"{kind}_base"
    v = tokenizer(base)
    torch.manual_seed(0)
    if kind == "bert":
        cfg = BertConfig(vocab_size=v, hidden_size=768, num_hidden_layers=6, num_attention_heads=12,
                         intermediate_size=3072, max_position_embeddings=512)
        pooling = "mean"
    else:
        cfg = Qwen3Config(vocab_size=v, hidden_size=768, num_hidden_layers=6, num_attention_heads=12,
                          num_key_value_heads=4, head_dim=64, intermediate_size=2048, max_position_embeddings=1024,
                          pad_token_id=0, bos_token_id=2, eos_token_id=3)
        pooling = "lasttoken"
    AutoModel.from_config(cfg).save_pretrained(base)
    t = models.Transformer(str(base))
    st = SentenceTransformer(modules=[t, models.Pooling(t.get_embedding_dimension(), pooling_mode=pooling),
                                      models.Normalize()], device="cpu")
    path = root / kind
    st.save(str(path))
    tokenizer(path)
    return path


def real_sentences(n: int) -> list[str]:
    """Real English sentences: all-MiniLM-L6-v2's model card, and the text fields of the shipped
    configs' and the tests' JSONL data, cycled to n."""
    import re

    from engine.models import real_model_file

    directory, _ = real_model_file("builtin:all-minilm-l6-v2")
    card = re.sub(r"```.*?```", " ", (directory / "README.md").read_text(), flags=re.S)  # no code
    found = [line.strip(" #*->|") for line in card.splitlines()
             if len(line.split()) >= 6 and not re.search(r"[=<>{}`]|https?:", line)]
    repo = Path(__file__).resolve().parents[1]
    for path in [*(repo / "configs" / "data").glob("*.jsonl"), *(repo / "tests" / "data").glob("*.jsonl")]:
        for line in path.read_text().splitlines():
            row = json.loads(line)
            found += [v for k, v in row.items() if isinstance(v, str) and len(v.split()) >= 4]
            found += [m["content"] for m in row.get("messages") or [] if isinstance(m, dict) and isinstance(m.get("content"), str)]
    found = [s for s in dict.fromkeys(found) if len(s.split()) >= 4]
    return [found[i % len(found)] for i in range(n)]


def run(kind: str, rows: list[str], root: Path, device: str, budget: int | None) -> dict:
    from sentence_transformers import SentenceTransformer

    from engine import EngineConfig, LLMEngine
    from engine.models import real_model_file

    path = real_model_file("builtin:all-minilm-l6-v2")[0] if kind == "minilm" else build(kind, root)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    st = SentenceTransformer(str(path), device=device, model_kwargs={"dtype": dtype})
    st.encode(rows[:32], batch_size=32)  # warm-up
    t0 = time.perf_counter()
    ref = st.encode(rows, batch_size=32, convert_to_numpy=True)
    st_s = time.perf_counter() - t0
    llm = LLMEngine(EngineConfig(model=str(path), device=device, max_num_batched_tokens=budget))
    llm.embed(rows[:32])
    t0 = time.perf_counter()
    out = llm.embed(rows)
    ours_s = time.perf_counter() - t0
    got = np.array([o.embedding for o in out], dtype=np.float64)
    ref = ref.astype(np.float64)
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    stats = llm.batch_stats[-1]
    return {"model": kind, "device": device, "rows": len(rows), "tokens": stats.prompt_tokens,
            "padded_tokens": stats.padded_prompt_tokens, "budget": llm.max_num_batched_tokens,
            "st_rows_per_s": round(len(rows) / st_s, 2), "engine_rows_per_s": round(len(rows) / ours_s, 2),
            "speedup": round(st_s / ours_s, 3), "min_cosine": float(cos.min())}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--texts", type=int, default=2000)
    ap.add_argument("--model", choices=("bert", "qwen3", "both", "minilm"), default="both")
    ap.add_argument("--budget", type=int, default=None, help="max_num_batched_tokens (default: the engine's)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="also write the results here as JSON")
    args = ap.parse_args()
    rows = real_sentences(args.texts) if args.model == "minilm" else texts(args.texts)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in (("bert", "qwen3") if args.model == "both" else (args.model,)):
            results.append(run(kind, rows, Path(tmp), args.device, args.budget))
            print(json.dumps(results[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
