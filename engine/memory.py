"""Sizing the KV pool from the card's memory (CUDA, max_batch_tokens None), as vLLM does.

The pool gets what `gpu_memory_utilization` of the card leaves after the weights and the peak
activations of one profiling pass at `max_num_batched_tokens` (the largest pass the scheduler
will ever run), measured with a pool just large enough for that pass.
"""
from __future__ import annotations

import logging

import torch

from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledChunk
from engine.sequence import Sequence

log = logging.getLogger(__name__)


@torch.inference_mode()
def profile_pool_blocks(llm) -> int:
    """Blocks of the pool on this CUDA device for `llm` (an LLMEngine being built)."""
    runner, bs = llm.runner, llm.block_size
    device = runner.device
    tokens = llm.max_num_batched_tokens
    rows = []
    while tokens > 0:
        n = min(tokens, llm.max_model_len)
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
    per_block = probe.nbytes() // blocks
    runner.drop_cache(probe)
    del probe
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    outside = total - free - torch.cuda.memory_reserved(device)  # other processes, CUDA context
    budget = int(total * llm.config.gpu_memory_utilization) - peak - max(outside, 0)
    num = budget // per_block if per_block else 0
    if num * bs < llm.max_model_len:
        raise RuntimeError(f"gpu_memory_utilization={llm.config.gpu_memory_utilization} leaves room for "
                           f"{num * bs} KV tokens after weights and activations (peak {peak / 2**30:.1f} GiB "
                           f"of {total / 2**30:.1f} GiB), fewer than max_model_len ({llm.max_model_len}): raise it, "
                           "lower max_model_len or max_num_batched_tokens, or set max_batch_tokens")
    log.info("KV pool: %d blocks of %d tokens (%.1f GiB) from gpu_memory_utilization=%.2f", num, bs,
             num * per_block / 2**30, llm.config.gpu_memory_utilization)
    return int(num)
