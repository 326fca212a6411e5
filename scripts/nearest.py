#!/usr/bin/env python
"""Prints the nearest document of each query: the queries are embedded by the job's own model
(its manifest's spec), the documents' embeddings read from the job's output.

    .venv/bin/python scripts/nearest.py OUTPUT_DIR --queries configs/data/queries.jsonl
"""
from __future__ import annotations

import argparse
import json

import fsspec
import numpy as np

from engine import EngineConfig, LLMEngine
from pipeline.index import part_entries
from pipeline.io import decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("output")
    ap.add_argument("--queries", required=True, help="a JSONL file with a `query` per line")
    ap.add_argument("--text-column", default="text")
    args = ap.parse_args()
    fs, root = fsspec.core.url_to_fs(args.output)
    manifest = json.loads(fs.cat_file(root.rstrip("/") + "/manifest.json"))
    ids, texts, vectors = [], [], []
    for part in part_entries(args.output):
        with fsspec.open(part["path"], "rb") as f:
            for row in decode(f.read(), manifest["format"]).to_pylist():
                if row.get("embedding") is not None:
                    ids.append(row["id"])
                    texts.append(row.get(args.text_column) or row.get("prompt") or "")
                    vectors.append(row["embedding"])
    docs = np.asarray(vectors, dtype=np.float32)
    docs /= np.linalg.norm(docs, axis=1, keepdims=True)
    with open(args.queries) as f:
        queries = [json.loads(line)["query"] for line in f if line.strip()]
    llm = LLMEngine(EngineConfig(model=manifest["spec"]["model"]))
    for query, out in zip(queries, llm.embed(queries)):
        q = np.asarray(out.embedding, dtype=np.float32)
        scores = docs @ (q / np.linalg.norm(q))
        best = int(scores.argmax())
        print(f"{query!r}\n    -> {ids[best]}: {texts[best]!r} (cosine {scores[best]:.3f})")


if __name__ == "__main__":
    main()
