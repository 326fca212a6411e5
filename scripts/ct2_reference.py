#!/usr/bin/env python
"""CTranslate2 reference runner: the same greedy, ignore-EOS workload on CTranslate2's CPU generator.

Import it from a benchmark (`sys.path` or `importlib`) and call
    available() -> str | None          None if ctranslate2 imports, else why not
    convert(model_dir, out_dir) -> str  HF model dir -> CTranslate2 dir (float32), cached
    generate(ct2_dir, prompts, max_tokens, *, threads, max_batch_tokens) -> dict
or run it standalone to convert builtin:llama-42m and check CTranslate2's tokens against
transformers' greedy generate() (8 prompts of 32 tokens, 16 new tokens each):

    .venv/bin/python scripts/ct2_reference.py [--threads 2]

How the workload maps onto CTranslate2 (checked against ctranslate2 4.8.5):
  * Prompts are token ids; CTranslate2 takes token strings, so ids are mapped through the
    vocabulary the converter wrote (vocabulary.json; the byte tokenizer's 259 tokens, then
    `<extra_id_N>` up to the model's 32000 rows, so every id has a unique string).
  * include_prompt_in_result=False: the prompt is forwarded at once and `max_length` counts
    generated tokens only. (With the default True, the result holds the prompt and max_length
    counts the prompt as well.)
  * ignore_eos: end_token=[] means "no end token": EOS is neither a stop nor suppressed, the
    engine's ignore_eos semantics. (end_token=None or "" falls back to the model's EOS.)
  * Per-request max_tokens: generate_batch has one max_length per call, so it is set to the
    largest, and, when lengths differ, a step callback stops each request at its own count.
    The callback counts calls per batch_id: its `step` is not the generated-token index for a
    prompt longer than the shortest one in its sub-batch.
  * max_batch_tokens -> max_batch_size with batch_type="tokens": CTranslate2 sorts requests by
    prompt length and fills each batch up to that many *prompt* tokens; unlike the engine's
    budget it does not reserve room for the tokens still to be generated.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

_SOURCE_MARKER = "batchinfer_ct2_source.json"
_QUANTIZATION = "float32"


def available() -> str | None:
    """None if ctranslate2 imports, else the reason it does not."""
    try:
        import ctranslate2  # noqa: F401
    except Exception as exc:  # ImportError, or a broken shared library (OSError)
        return f"{type(exc).__name__}: {exc}"
    return None


def _source_fingerprint(model_dir: Path) -> dict:
    import ctranslate2

    files = {}
    for f in sorted(model_dir.iterdir()):
        if f.is_file():
            st = f.stat()
            files[f.name] = [st.st_size, st.st_mtime_ns]
    return {"source": str(model_dir.resolve()), "files": files, "quantization": _QUANTIZATION,
            "ctranslate2": ctranslate2.__version__}


def convert(model_dir, out_dir) -> str:
    """Convert the Hugging Face model in `model_dir` to a float32 CTranslate2 model in `out_dir`.

    Skipped when `out_dir` already holds a conversion of the same source (same files, sizes and
    mtimes, same ctranslate2 version). Converts beside `out_dir` and renames, so a reader never
    sees half a model. Returns `out_dir` as a string.
    """
    import ctranslate2

    model_dir, out = Path(model_dir), Path(out_dir)
    fingerprint = _source_fingerprint(model_dir)
    marker = out / _SOURCE_MARKER
    if (out / "model.bin").exists() and marker.exists():
        try:
            if json.loads(marker.read_text()) == fingerprint:
                return str(out)
        except (OSError, ValueError):
            pass
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        ctranslate2.converters.TransformersConverter(str(model_dir)).convert(
            str(tmp), quantization=_QUANTIZATION, force=True)
        (tmp / _SOURCE_MARKER).write_text(json.dumps(fingerprint, indent=1))
        if out.exists():
            if not ((out / "model.bin").exists() or (out / _SOURCE_MARKER).exists()):
                raise FileExistsError(f"{out} exists and is not a CTranslate2 model; not replacing it")
            shutil.rmtree(out)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def _vocabulary(ct2_dir: Path) -> list[str]:
    """Token strings by id, from the vocabulary file the converter wrote."""
    if (ct2_dir / "vocabulary.json").exists():
        return json.loads((ct2_dir / "vocabulary.json").read_text(encoding="utf-8"))
    if (ct2_dir / "vocabulary.txt").exists():  # older converters: one token per line
        return (ct2_dir / "vocabulary.txt").read_text(encoding="utf-8").split("\n")[:-1]
    raise FileNotFoundError(f"no vocabulary.json or vocabulary.txt in {ct2_dir}")


def generate(ct2_dir, prompts: list[list[int]], max_tokens: list[int], *, threads: int,
             max_batch_tokens: int, batch_rows: int | None = None, warmup: bool = True,
             compute_type: str = "float32") -> dict:
    """Greedy generation of exactly max_tokens[i] tokens for prompts[i] (EOS does not stop it).

    Runs ctranslate2.Generator on the CPU, in `compute_type` (float32, or int8: weights quantized
    to int8 as the model loads, CPU users' usual pick), `threads` intra-op threads (0: CTranslate2's
    default), one batch at a time, token-batched at `max_batch_tokens` prompt tokens, or, with
    `batch_rows`, in batches of that many requests (to hold the same KV memory as the engine).
    Only generate_batch is timed: loading, and a tiny warm-up call when `warmup`, are not.
    Returns {"seconds", "generated_tokens", "outputs" (generated ids per request, in order),
    "load_seconds"}.
    """
    import ctranslate2

    if len(prompts) != len(max_tokens):
        raise ValueError(f"{len(prompts)} prompts but {len(max_tokens)} max_tokens")
    if not prompts:
        return {"seconds": 0.0, "generated_tokens": 0, "outputs": [], "load_seconds": 0.0}
    if min(max_tokens) < 1:
        raise ValueError("every max_tokens must be >= 1")
    ct2_dir = Path(ct2_dir)
    vocab = _vocabulary(ct2_dir)
    try:
        tokens = [[vocab[i] for i in p] for p in prompts]
    except IndexError:
        raise ValueError(f"a prompt id is outside the vocabulary (size {len(vocab)})") from None

    start = time.perf_counter()
    generator = ctranslate2.Generator(str(ct2_dir), device="cpu", compute_type=compute_type,
                                      intra_threads=threads, inter_threads=1)
    load_seconds = time.perf_counter() - start
    batching = (dict(max_batch_size=batch_rows, batch_type="examples") if batch_rows
                else dict(max_batch_size=max_batch_tokens, batch_type="tokens"))
    options = dict(**batching, beam_size=1, sampling_topk=1,
                   end_token=[], include_prompt_in_result=False)
    if warmup:
        generator.generate_batch(tokens[:1], max_length=2, **options)

    callback = None
    if len(set(max_tokens)) > 1:
        counts = [0] * len(prompts)

        def callback(step) -> bool:  # True stops this request
            counts[step.batch_id] += 1
            return counts[step.batch_id] >= max_tokens[step.batch_id]

    start = time.perf_counter()
    results = generator.generate_batch(tokens, max_length=max(max_tokens), callback=callback, **options)
    seconds = time.perf_counter() - start
    outputs = [list(r.sequences_ids[0]) for r in results]
    wrong = [(i, len(o), m) for i, (o, m) in enumerate(zip(outputs, max_tokens)) if len(o) != m]
    if wrong:
        raise RuntimeError(f"CTranslate2 generated the wrong number of tokens (request, got, wanted): {wrong[:5]}")
    del generator
    return {"seconds": seconds, "generated_tokens": sum(len(o) for o in outputs), "outputs": outputs,
            "load_seconds": load_seconds}


def _hf_greedy(model_dir, prompts, max_tokens, threads: int) -> tuple[list[list[int]], float]:
    """transformers generate(), one request at a time, greedy, EOS neither stops nor is masked."""
    import torch
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = []
    start = time.perf_counter()
    with torch.inference_mode():
        for ids, m in zip(prompts, max_tokens):
            x = torch.tensor([ids])
            g = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=m, min_new_tokens=m,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
            outputs.append(g[0, len(ids):].tolist())
    return outputs, time.perf_counter() - start


def main() -> None:
    import argparse
    import random

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:llama-42m")
    ap.add_argument("--out", default=None, help="CTranslate2 model dir (default: under the batchinfer cache)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    reason = available()
    if reason:
        raise SystemExit(f"ctranslate2 is not usable: {reason}")
    import ctranslate2
    from engine.models import builtin_path, default_cache_dir, is_builtin

    model_dir = builtin_path(args.model) if is_builtin(args.model) else Path(args.model)
    out = args.out or default_cache_dir() / "ct2" / f"{Path(model_dir).name}-{_QUANTIZATION}"
    start = time.perf_counter()
    ct2_dir = convert(model_dir, out)
    print(f"ctranslate2 {ctranslate2.__version__}: {model_dir} -> {ct2_dir} ({time.perf_counter() - start:.1f}s)")

    vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    max_tokens = [args.max_tokens] * args.requests
    budget = args.requests * (args.prompt_len + args.max_tokens)
    ct2 = generate(ct2_dir, prompts, max_tokens, threads=args.threads, max_batch_tokens=budget)
    print(f"ctranslate2: {ct2['generated_tokens']} tokens in {ct2['seconds']:.3f}s = "
          f"{ct2['generated_tokens'] / ct2['seconds']:.0f} tok/s ({args.threads} threads, "
          f"max_batch_tokens={budget}; load {ct2['load_seconds']:.2f}s, not timed)")
    ref, secs = _hf_greedy(model_dir, prompts, max_tokens, args.threads)
    print(f"transformers generate, 1 at a time: {sum(max_tokens)} tokens in {secs:.3f}s = "
          f"{sum(max_tokens) / secs:.0f} tok/s")
    same = 0
    for i, (a, b) in enumerate(zip(ct2["outputs"], ref)):
        if a == b:
            same += 1
        else:
            first = next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
            print(f"  request {i}: diverges at generated token {first}: ct2 {a[first:first + 4]} "
                  f"vs transformers {b[first:first + 4]}")
    print(f"same tokens as transformers: {same}/{len(ref)}")


if __name__ == "__main__":
    main()
