#!/usr/bin/env python
"""llama.cpp reference runner: the same greedy, ignore-EOS workload on llama.cpp (llama-cpp-python's
low-level API), over a GGUF file as it is stored (SmolLM2's Q4_1: llama.cpp computes on the 4-bit
blocks, so its row is held against the engine's int4).

Import it from a benchmark (`sys.path` or `importlib`) and call
    available() -> str | None                       None if llama_cpp imports, else why not
    generate(gguf, prompts, max_tokens, *, threads) -> {"outputs": [[ids]], "seconds": float}

How the workload maps onto llama.cpp (checked against llama-cpp-python 0.3.36):
  * Prompts are token ids of the GGUF-built tokenizer: the file's own vocabulary, so llama.cpp
    reads them as they are.
  * Every request is its own sequence in one context (`n_seq_max` = the requests), all decoded
    together: one `llama_batch` per step holds each running sequence's next token (batched
    decoding, as llama.cpp's `batched` example does), the prompts first in chunks of `n_batch`.
  * Greedy on the logits llama.cpp returns for each sequence's last token (numpy argmax); EOS is
    not a stop: each request runs to its own max_tokens (the engine's ignore_eos).
  * Only the generation is timed: the model load and the context are made before.

llama-cpp-python has no wheel on the package registry: `pip install -e .[llamacpp]` builds it
from source with CMake (about 10 minutes on 2 cores).
"""
from __future__ import annotations

import time


def available() -> str | None:
    """None if llama_cpp imports, else the reason it does not."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as exc:  # ImportError, or a broken shared library (OSError)
        return f"{type(exc).__name__}: {exc}"
    return None


def _quiet_log(level, text, user_data):
    return None


_QUIET = None


def generate(gguf: str, prompts: list[list[int]], max_tokens: list[int], *, threads: int,
             n_batch: int = 512) -> dict:
    import ctypes

    import llama_cpp
    import numpy as np

    global _QUIET
    if _QUIET is None:
        _QUIET = llama_cpp.llama_log_callback(_quiet_log)  # held: llama.cpp keeps the pointer

    llama_cpp.llama_log_set(_QUIET, ctypes.c_void_p(0))  # llama.cpp logs every tensor it loads otherwise
    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf}")
    vocab = llama_cpp.llama_model_get_vocab(model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    n_seq = len(prompts)
    longest = max(len(p) + m for p, m in zip(prompts, max_tokens))
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = n_seq * (-(-longest // 256) * 256)
    cparams.n_batch = cparams.n_ubatch = n_batch
    cparams.n_seq_max = n_seq
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    if not ctx:
        raise RuntimeError("llama.cpp could not make a context")
    batch = llama_cpp.llama_batch_init(max(n_batch, n_seq), 0, n_seq)

    def decode(entries):
        """entries: (token, pos, seq, wants logits); returns seq -> its greedy next token, for each wanted one."""
        wanted = {}
        for start in range(0, len(entries), n_batch):
            chunk = entries[start:start + n_batch]
            batch.n_tokens = len(chunk)
            for i, (tok, pos, seq, logits) in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = logits
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            for i, (_, _, seq, logits) in enumerate(chunk):
                if logits:
                    ptr = llama_cpp.llama_get_logits_ith(ctx, i)
                    row = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,))
                    wanted[seq] = int(row.argmax())
        return wanted

    outputs: list[list[int]] = [[] for _ in prompts]
    try:
        start = time.perf_counter()
        entries = [(tok, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
        nxt = decode(entries)
        while True:
            for s, tok in nxt.items():
                outputs[s].append(tok)
            running = [s for s in range(n_seq) if len(outputs[s]) < max_tokens[s]]
            if not running:
                break
            nxt = decode([(outputs[s][-1], len(prompts[s]) + len(outputs[s]) - 1, s, True) for s in running])
        seconds = time.perf_counter() - start
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    return {"outputs": outputs, "seconds": seconds}
