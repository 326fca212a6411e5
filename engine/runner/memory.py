"""Sizing the KV pool from the card's memory (CUDA, max_batch_tokens None), as vLLM does.

The pool gets what `gpu_memory_utilization` of the card leaves after the weights and the peak
activations of one profiling pass at `max_num_batched_tokens` (the largest pass the scheduler
will ever run), measured with a pool just large enough for that pass, and after this engine's
memory outside torch's allocator (library workspaces) grown since it started. The fraction is
this engine's share of the card, as in vLLM: memory other processes held when it started does
not count against it (two engines at 0.45 share one card), but it must have been free.
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys

import torch

from engine.api.config import CPU_POOL_TOKENS
from engine.api.errors import PoolSizingError
from engine.api.sampling_params import SamplingParams
from engine.core.scheduler import ScheduledChunk
from engine.core.sequence import Sequence, collect_tokens

log = logging.getLogger(__name__)

CPU_HEAP_BYTES = 256 << 20
"""Host buffers up to this size come from glibc's heap and stay there once freed (see
keep_cpu_buffers)."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
_tuned: list[bool] = []


def keep_cpu_buffers() -> bool:
    """Lets a CPU engine reuse its large per-pass buffers instead of mapping them anew.

    glibc serves each allocation above its mmap threshold with a fresh mmap and returns it with
    munmap when freed. A decode pass's logits (16 MiB at 256 rows x 16k vocabulary, 128 MiB at
    128k) are such allocations, so every step paid the page faults of a new buffer and an munmap:
    about 1 ms each at 16 MiB, as much as the rest of the step's host work. Raising the mmap and
    trim thresholds to CPU_HEAP_BYTES keeps freed buffers in the heap for the next pass (the
    process holds on to at most that much freed memory beyond what it uses). Once per process,
    Linux with glibc only; BATCHINFER_MALLOC_TUNING=0 leaves the allocator alone. True when applied."""
    if _tuned:
        return _tuned[0]
    applied = False
    if sys.platform.startswith("linux") and os.environ.get("BATCHINFER_MALLOC_TUNING", "1") != "0":
        try:
            libc = ctypes.CDLL("libc.so.6")
            applied = bool(libc.mallopt(_M_MMAP_THRESHOLD, CPU_HEAP_BYTES)) and bool(
                libc.mallopt(_M_TRIM_THRESHOLD, CPU_HEAP_BYTES))
        except (OSError, AttributeError):  # not glibc (musl, ...): nothing to tune
            applied = False
    _tuned.append(applied)
    return applied


def used_before_load(device: torch.device) -> tuple[int, int]:
    """(bytes of the card in use outside this process's torch allocator: other processes' and this
    process's CUDA context; bytes its live tensors hold, an engine still running beside this one)
    before an engine loads its weights. What the allocator caches but no tensor holds, left by an
    engine since dropped, is free for this one. Its share (gpu_memory_utilization) is counted
    apart from both."""
    free, total = torch.cuda.mem_get_info(device)
    return total - free - torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)


class LoadPeak:
    """The memory a model's load adds at its peak: on CUDA, the allocator's peak over what it held
    before; elsewhere, the process's resident high-water mark (VmHWM) over its resident memory
    before (0 where /proc is not there), the mark reset first (/proc/self/clear_refs) so that an
    earlier peak of the process (an engine since dropped, a warm-up) does not count. Less the code
    of shared libraries that the load's first calls paged in: clean pages of torch's libraries,
    not memory the load holds (measured: 13.5 of the 14 MiB that building a Llama on the meta
    device added in a fresh tensor-parallel rank). A context manager; `bytes` once it exits."""

    def __init__(self, device: torch.device):
        self.device, self.bytes = device, 0

    def __enter__(self) -> "LoadPeak":
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._before = torch.cuda.memory_allocated(self.device)
        else:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # VmHWM := VmRSS (Linux >= 4.0)
            except OSError:
                pass
            self._code = library_pages()
            self._before = _proc_status("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._before
        elif self._before is not None:
            paged_in = max(0, library_pages() - self._code)
            self.bytes = max(0, (_proc_status("VmHWM") or 0) - self._before - paged_in)


def library_pages() -> int:
    """Resident bytes of the process's shared libraries' mappings (/proc/self/smaps; 0 without it)."""
    total, library = 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:  # a mapping's first line
                    fields = line.split(None, 5)  # range, perms, offset, device, inode[, path]
                    library = len(fields) > 5 and ".so" in fields[5].strip().rsplit("/", 1)[-1]
                elif library and line.startswith("Rss:"):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return total


def _proc_status(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@torch.inference_mode()
def profile_pool_blocks(runner, bs: int, max_num_batched_tokens: int, max_model_len: int, util: float) -> int:
    """Blocks of `bs` tokens of the KV pool on this CUDA device for an engine being built around
    `runner`, under `util` (gpu_memory_utilization), after a profiling pass of a full budget."""
    device = runner.device
    tokens = max_num_batched_tokens
    rows = []
    while tokens > 0:
        n = min(tokens, max_model_len)
        rows.append(n)
        tokens -= n
    blocks = sum(-(-n // bs) for n in rows)
    probe = runner.new_cache(blocks, bs)
    chunks, next_block = [], 0
    for i, n in enumerate(rows):
        seq = Sequence(index=i, prompt_token_ids=[0] * n, params=SamplingParams(max_tokens=1), seed=0)
        seq.block_ids = list(range(next_block, next_block + -(-n // bs)))
        next_block += len(seq.block_ids)
        chunks.append(ScheduledChunk(seq, 0, n))
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    runner.run(probe, chunks)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    per_block = probe.nbytes() // probe.physical_blocks
    runner.drop_cache(probe)
    del probe
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    outside, live = runner.memory_before_load or (0, 0)  # not measured at load: all of it counts
    if total - outside - live < int(total * util):
        raise PoolSizingError(f"gpu_memory_utilization={util} asks for {total * util / 2**30:.1f} GiB of the "
                              f"{total / 2**30:.1f} GiB card, but only {(total - outside - live) / 2**30:.1f} GiB were "
                              f"free when the engine started (other processes or engines held the rest): lower it, or "
                              f"free the card")
    # what this engine holds outside torch's allocator since it started (cuBLAS, NCCL workspaces),
    # and at its peak beyond what this process's tensors held before it loaded
    own_outside = max(0, total - free - torch.cuda.memory_reserved(device) - outside)
    budget = int(total * util) - (peak - live) - own_outside - prompt_logits_bytes(runner.vocab_size)
    num = budget // per_block if per_block else 0
    if num * bs < max_model_len:
        raise PoolSizingError(f"gpu_memory_utilization={util} leaves room for "
                              f"{num * bs} KV tokens after weights and activations (peak {peak / 2**30:.1f} GiB "
                              f"of {total / 2**30:.1f} GiB), fewer than max_model_len ({max_model_len}): raise it, "
                              "lower max_model_len or max_num_batched_tokens, or set max_batch_tokens")
    log.info("KV pool: %d blocks of %d tokens (%.1f GiB) from gpu_memory_utilization=%.2f", num, bs,
             num * per_block / 2**30, util)
    return int(num)


def prompt_logits_bytes(vocab_size: int) -> int:
    """What a pass collecting prompt logprobs holds beyond the profile's pass, which keeps one row
    of logits per prompt: its kept rows of logits (engine.sample.prompt_logprobs bounds them) and
    their log-softmax, float32. Reserved whether or not a request asks: the pool is sized once."""
    return 2 * collect_tokens(vocab_size) * vocab_size * 4


def kv_bytes_per_token(runner) -> int:
    """Keys and values of one token over all layers, from the model's config."""
    text = runner.model.config.get_text_config(decoder=True)
    heads = getattr(text, "num_attention_heads", None) or getattr(text, "n_head")
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or (getattr(text, "hidden_size", None) or text.n_embd) // heads
    size = (runner.kv_dtype or runner.dtype).itemsize
    return 2 * runner.num_layers * kv_heads * head_dim * size


def memory_report(runner, config, cache, pool) -> dict:
    """An engine's KV pool (blocks, block size, tokens, bytes) and its weights' bytes (LLMEngine.memory);
    an encoder (no cache) has weights only."""
    if cache is None:
        return {"kv_blocks": 0, "block_size": 0, "kv_tokens": 0, "kv_bytes": 0,
                "weights_bytes": runner.weights_nbytes, "unquantized_weights_bytes": runner.weights_nbytes,
                "quantization": None, "kv_cache_dtype": config.kv_cache_dtype, "tensor_parallel_size": 1,
                "load_peak_bytes": getattr(runner, "load_peak_bytes", 0)}
    block_size = pool.block_size
    tokens = pool.num_blocks * block_size
    per_token = (cache.nbytes() // (cache.physical_blocks * block_size) if cache.allocated
                 else kv_bytes_per_token(runner))
    return {"kv_blocks": pool.num_blocks, "block_size": block_size, "kv_tokens": tokens,
            "kv_bytes": per_token * tokens,  # the pool's blocks (not the one spare block graphs pad into)
            "weights_bytes": runner.weights_nbytes, "unquantized_weights_bytes": runner.unquantized_nbytes,
            "quantization": runner.quantization, "kv_cache_dtype": config.kv_cache_dtype,
            "tensor_parallel_size": config.tensor_parallel_size, "load_peak_bytes": runner.load_peak_bytes,
            "streamed": getattr(runner, "streamed", False), **rank_loads(runner)}


def rank_loads(runner) -> dict:
    """Under tensor parallelism, every rank's weights' bytes and load peak, rank 0 first (each as
    its own process measured it); nothing with one rank."""
    others = getattr(runner, "rank_loads", [])
    if not others:
        return {}
    return {"rank_weights_bytes": [runner.weights_nbytes] + [r["weights_bytes"] for r in others],
            "rank_load_peak_bytes": [runner.load_peak_bytes] + [r["load_peak_bytes"] for r in others]}


def engine_weights_facts(runner) -> tuple[dict | None, dict | None]:
    """(fast paths, GGUF source) of a model runner, for EngineFacts: each fast path's state where
    one was checked or fell back (engine.runner.fast_paths), and the GGUF file it was read from."""
    from engine.models import gguf_source

    paths = getattr(runner, "paths", None)  # a tensor-parallel front may have none
    source = gguf_source(getattr(runner, "model_dir", None) or "")
    return (paths.facts() if paths is not None and paths.state else None), source


def pool_blocks(runner, config, block_size: int, max_num_batched_tokens: int, max_model_len: int) -> int:
    """The KV pool's blocks: max_batch_tokens' worth; unset, what one pass of rows needs for a pooling
    model, the card's free memory on CUDA (profile_pool_blocks), else CPU_POOL_TOKENS' worth."""
    tokens = config.max_batch_tokens
    if tokens is None and runner.head != "causal":  # pooling only: what one pass of rows needs
        return -(-max(max_num_batched_tokens, max_model_len) // block_size) + config.max_num_seqs
    if tokens is None and runner.device.type == "cuda":
        return profile_pool_blocks(runner, block_size, max_num_batched_tokens, max_model_len,
                                   config.gpu_memory_utilization)
    return max(1, (tokens or CPU_POOL_TOKENS) // block_size)  # the pool never exceeds the budget


def model_len(runner, config) -> int:
    """max_model_len as configured (checked against the model's positions), else the model's, else the
    KV budget."""
    model_max = runner.max_position_embeddings
    if config.max_model_len is None:
        return model_max or (config.max_batch_tokens or CPU_POOL_TOKENS)
    if model_max and config.max_model_len > model_max:
        raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the model's "
                         f"max_position_embeddings ({model_max})")
    return config.max_model_len
