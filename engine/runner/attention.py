"""Attention over the paged KV pool, plugged into every architecture through transformers'
attention-function registry (`AttentionInterface`), so each model's own modeling code runs
unchanged and no dense mask is ever built.

A forward pass packs its tokens into one sequence of T tokens (batch size 1): decode rows
contribute one token, prefill chunks several. The KV layer of the pool writes each new token's
keys and values at its slot before attention runs, so every query token attends to the first
`ctx[t]` positions of its own row (its position + 1), within the layer's sliding window:

- tokens of short chunks and decode rows go through one per-token path: on CPU in float32 a
  C++ kernel that reads keys and values in place from the blocks (compiled on first use;
  `reference_token_attention` otherwise, which gathers them);
- a long prefill chunk gathers its row's blocks once and runs SDPA (causal within the chunk,
  all earlier positions of the row; GQA without repeating K/V).

On CUDA, with triton importable, both go through Triton kernels instead
(`engine.runner.kernels.triton_attention`: split-KV decode, and all long chunks of a pass in one
causal launch), reading the blocks in place; BATCHINFER_TRITON=0 keeps the torch paths.

Logit soft-capping (Gemma 2) is applied in both paths.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.api.errors import AttentionOutsideEngine, one_line
from engine.runner.fast_paths import FastPaths, attention_tolerance
from engine.runner.kernel_build import KernelBuild, report

log = logging.getLogger(__name__)

IMPLEMENTATION = "batchinfer_paged"
"""The name this attention is registered under (the model's attn_implementation)."""
CHUNK_MIN_TOKENS = 32
"""Chunks at least this long take the gather + SDPA path (compute-bound: the gather is amortised)."""


@dataclass
class PassMetadata:
    """Where the tokens of one forward pass sit in the pool, as device tensors."""

    slot_mapping: torch.Tensor
    """(T,) int64: pool slot (block * block_size + offset) each token's keys and values go to."""
    block_tables: torch.Tensor
    """(R, max_blocks) int32: each row's blocks in position order (padded with 0)."""
    token_row: torch.Tensor
    """(T,) int32: the row of each token (an index into block_tables)."""
    ctx: torch.Tensor
    """(T,) int32: positions each token attends to (its own position + 1)."""
    max_ctx: int
    """Largest ctx (known on the host, so no kernel asks the device)."""
    small: torch.Tensor | None
    """Indices of the tokens the per-token path computes; None = all of them."""
    chunks: list[tuple[int, int, int, int]]
    """(first token, last token + 1, row, position of the first token) of each long chunk."""
    chunk_spans: torch.Tensor | None = None
    """(C, 4) int32: `chunks` on the device, made by the Triton path once per pass."""


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            sliding_window=None, softcap=None, **kwargs):
    """The registered attention function. query (1, H, T, D) -> ((1, T, H, D), None)."""
    meta: PassMetadata | None = kwargs.get("batchinfer_pass")
    cache = kwargs.get("batchinfer_cache")
    if meta is None or cache is None:
        raise AttentionOutsideEngine(f"{IMPLEMENTATION} attention runs only inside batchinfer's engine")
    layer = cache.layers[module.layer_idx]
    q = query[0].transpose(0, 1)  # (T, H, D)
    scale = float(scaling) if scaling is not None else q.shape[-1] ** -0.5
    window = int(sliding_window or 0)
    cap = float(softcap or 0.0)
    paths = cache.paths
    if meta.small is None and not meta.chunks:
        return token_attention(q, layer.keys, layer.values, meta, scale, window, cap, paths)[None], None
    out = torch.empty_like(q)
    if meta.small is not None and meta.small.numel():
        sub = PassMetadata(meta.slot_mapping, meta.block_tables, meta.token_row[meta.small], meta.ctx[meta.small],
                           meta.max_ctx, None, [])
        out[meta.small] = token_attention(q[meta.small], layer.keys, layer.values, sub, scale, window, cap, paths)
    fast = _triton_kernels(q)
    if fast is not None and meta.chunks and checked_kernel(paths, "triton_prefill", fast, q, layer.keys, window, cap):
        if meta.chunk_spans is None:
            meta.chunk_spans = torch.tensor(meta.chunks, dtype=torch.int32, device=q.device)
        fast.chunk_attention(q, layer.keys, layer.values, meta.block_tables, meta.chunk_spans,
                             max(t1 - t0 for t0, t1, _, _ in meta.chunks), out, scale, window, cap)
        return out[None], None
    for t0, t1, row, start in meta.chunks:
        out[t0:t1] = chunk_attention(q[t0:t1], layer.keys, layer.values, meta.block_tables[row], start,
                                     scale, window, cap)
    return out[None], None


def token_attention(q, k_pool, v_pool, meta: PassMetadata, scale: float, window: int, softcap: float,
                    paths: FastPaths | None = None):
    """q (T, H, D) -> (T, H, D): token t over positions [ctx - window, ctx) of its row. With `paths`
    (the engine's), a kernel serves only once it passed its check for that engine."""
    fast = _triton_kernels(q)
    if fast is not None and checked_kernel(paths, "triton_decode", fast, q, k_pool, window, softcap):
        return fast.paged_decode(q, k_pool, v_pool, meta.block_tables, meta.token_row, meta.ctx, meta.max_ctx,
                                 scale, window, softcap)
    kernel = _cpu_kernel() if q.device.type == "cpu" and q.dtype == k_pool.dtype == torch.float32 else None
    if kernel is not None and checked_kernel(paths, "cpu_attention", kernel, q, k_pool, window, softcap):
        return kernel.paged_attention(q, k_pool, v_pool, meta.block_tables, meta.token_row, meta.ctx,
                                      scale, window, softcap)
    return reference_token_attention(q, k_pool, v_pool, meta.block_tables, meta.token_row, meta.ctx,
                                     meta.max_ctx, scale, window, softcap)


def reference_token_attention(q, k_pool, v_pool, block_tables, token_row, ctx, max_ctx: int, scale: float,
                              window: int = 0, softcap: float = 0.0):
    """The plain implementation: gathers each token's positions from the pool, then attends.
    q (T, H, D); pools (num_blocks, Hkv, block_size, D) -> (T, H, D)."""
    t, h, d = q.shape
    hkv, bs = k_pool.shape[1], k_pool.shape[2]
    pos = torch.arange(max_ctx, device=q.device)
    blocks = block_tables[token_row.long()][:, pos // bs].long()  # (T, L)
    keys = k_pool[blocks, :, pos % bs].to(q.dtype).transpose(1, 2)  # (T, Hkv, L, D)
    values = v_pool[blocks, :, pos % bs].to(q.dtype).transpose(1, 2)
    valid = pos[None, :] < ctx[:, None]
    if window:
        valid &= pos[None, :] >= (ctx[:, None] - window)
    qg = q.view(t, hkv, h // hkv, d)  # (T, Hkv, G, D)
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale  # (T, Hkv, G, L)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(q.dtype)
    return torch.matmul(probs, values).reshape(t, h, d)


def chunk_attention(q, k_pool, v_pool, blocks, start: int, scale: float, window: int = 0, softcap: float = 0.0):
    """One row's chunk: q (S, H, D) at positions [start, start + S), over the row's positions
    [0, start + S) read from `blocks` (its block table row). -> (S, H, D)."""
    s, h, d = q.shape
    end = start + s
    bs = k_pool.shape[2]
    nb = -(-end // bs)
    idx = blocks[:nb].long()
    keys = k_pool[idx].to(q.dtype).transpose(0, 1).reshape(k_pool.shape[1], nb * bs, d)[:, :end]  # (Hkv, L, D)
    values = v_pool[idx].to(q.dtype).transpose(0, 1).reshape(v_pool.shape[1], nb * bs, d)[:, :end]
    qh = q.transpose(0, 1)  # (H, S, D)
    mask = None
    if start or window or softcap:
        qpos = torch.arange(start, end, device=q.device)[:, None]
        kpos = torch.arange(end, device=q.device)[None, :]
        mask = kpos <= qpos
        if window:
            mask &= kpos > qpos - window
    if softcap:
        groups = h // keys.shape[0]
        k = keys.repeat_interleave(groups, dim=0)
        v = values.repeat_interleave(groups, dim=0)
        scores = torch.matmul(qh, k.transpose(-1, -2)).float() * scale
        scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.matmul(scores.softmax(dim=-1).to(q.dtype), v)
    else:
        out = F.scaled_dot_product_attention(qh[None], keys[None], values[None], attn_mask=mask,
                                             is_causal=mask is None, scale=scale, enable_gqa=True)[0]
    return out.transpose(0, 1)  # (S, H, D)


# -- the kernels' checks ---------------------------------------------------------------------

def checked_kernel(paths: FastPaths | None, path: str, kernel, q, k_pool, window: int, softcap: float) -> bool:
    """Whether `kernel` (a module: the C++ one for `cpu_attention`, the Triton one otherwise) may
    serve this engine: at its first use, it runs once on a tiny pool of this layer's shapes and
    dtypes against the reference (engine.runner.fast_paths)."""
    if paths is None:
        return True
    known = paths.usable(path)
    if known is not None:
        return known
    case = tiny_case(q, k_pool, chunk=path == "triton_prefill")
    fallback = "the torch attention" + (" (gather + SDPA)" if path == "triton_prefill" else "")
    return paths.check(path, lambda: run_kernel(path, kernel, case, window, softcap),
                       lambda: run_reference(path, case, window, softcap), attention_tolerance(q.dtype), fallback)


def tiny_case(q, k_pool, chunk: bool) -> dict:
    """A pool of 4 blocks of this layer's KV heads, block size, head size and dtype, random keys and
    values, and queries: two rows of one token each (at ctx 5 and block_size + 3), or with `chunk`
    one row's chunk of CHUNK_MIN_TOKENS tokens after 5 earlier positions."""
    gen = torch.Generator().manual_seed(0)
    heads, dim = q.shape[1], q.shape[2]
    kv_heads, bs = k_pool.shape[1], k_pool.shape[2]
    dev = q.device

    def rand(*shape, dtype=q.dtype):
        return torch.randn(*shape, generator=gen).to(device=dev, dtype=dtype)

    blocks = 4 + -(-(CHUNK_MIN_TOKENS + 5) // bs)
    k = rand(blocks, kv_heads, bs, dim, dtype=k_pool.dtype)
    v = rand(blocks, kv_heads, bs, dim, dtype=k_pool.dtype)
    tables = torch.arange(blocks, device=dev, dtype=torch.int32).flip(0)[None].repeat(2, 1).contiguous()
    if chunk:
        return {"q": rand(CHUNK_MIN_TOKENS, heads, dim), "k": k, "v": v, "tables": tables[:1], "start": 5,
                "scale": dim ** -0.5}
    ctx = torch.tensor([5, bs + 3], dtype=torch.int32, device=dev)
    return {"q": rand(2, heads, dim), "k": k, "v": v, "tables": tables,
            "rows": torch.arange(2, dtype=torch.int32, device=dev), "ctx": ctx, "max_ctx": bs + 3, "scale": dim ** -0.5}


def run_kernel(path: str, kernel, c: dict, window: int, softcap: float) -> torch.Tensor:
    if path == "triton_prefill":
        out = torch.empty_like(c["q"])
        n = c["q"].shape[0]
        spans = torch.tensor([[0, n, 0, c["start"]]], dtype=torch.int32, device=c["q"].device)
        kernel.chunk_attention(c["q"], c["k"], c["v"], c["tables"], spans, n, out, c["scale"], window, softcap)
        return out
    if path == "triton_decode":
        return kernel.paged_decode(c["q"], c["k"], c["v"], c["tables"], c["rows"], c["ctx"], c["max_ctx"],
                                   c["scale"], window, softcap)
    return kernel.paged_attention(c["q"], c["k"], c["v"], c["tables"], c["rows"], c["ctx"], c["scale"], window, softcap)


def run_reference(path: str, c: dict, window: int, softcap: float) -> torch.Tensor:
    if path == "triton_prefill":
        return chunk_attention(c["q"], c["k"], c["v"], c["tables"][0], c["start"], c["scale"], window, softcap)
    return reference_token_attention(c["q"], c["k"], c["v"], c["tables"], c["rows"], c["ctx"], c["max_ctx"],
                                     c["scale"], window, softcap)


# -- the kernels -----------------------------------------------------------------------------

_TRITON: list = []  # [module or None] once tried


def _triton_kernels(q: torch.Tensor):
    """engine.runner.kernels.triton_attention for CUDA tensors; None on CPU, without triton, or with
    BATCHINFER_TRITON=0 (triton is imported only here, so CPU installs never need it)."""
    if q.device.type != "cuda":
        return None
    if not _TRITON:
        module = None
        if os.environ.get("BATCHINFER_TRITON", "1") != "0":
            try:
                from engine.runner.kernels import triton_attention as module
            except ImportError as exc:
                log.warning("triton unavailable (%s); CUDA attention uses the torch paths (slower)", exc)
        _TRITON.append(module)
    return _TRITON[0]


_KERNEL: list = []  # [module or None] once tried


def _cpu_kernel():
    """The compiled C++ kernel, or None (it cannot be built here, or BATCHINFER_CPU_KERNEL=0)."""
    if not _KERNEL:
        module = None
        if os.environ.get("BATCHINFER_CPU_KERNEL", "1") != "0":
            try:
                module = load_cpu_kernel()
            except Exception as exc:  # noqa: BLE001  a binary that does not import: the reference path still works
                report(one_line(exc), None)
        _KERNEL.append(module)
    return _KERNEL[0]


def load_cpu_kernel(wait: bool = False):
    """The C++ kernel built for this machine and environment (engine.runner.kernel_build), or None:
    not built yet (the build then starts in the background, or with `wait` runs here) or cannot be."""
    return KernelBuild(Path(__file__).parent / "kernels" / "paged_attention_cpu.cpp", ("paged_attention",)).load(wait)


def register() -> str:
    """Registers the attention function with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, paged_attention_forward)
    return IMPLEMENTATION
