"""Paged attention: the CPU kernel, the plain reference and the chunk path agree, and the
reference equals dense causal attention over each row's positions."""
from __future__ import annotations

import pytest
import torch

from engine.runner.attention import chunk_attention, load_cpu_kernel, reference_token_attention


def pools(num_blocks=12, hkv=2, bs=4, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_blocks, hkv, bs, d, generator=g), torch.randn(num_blocks, hkv, bs, d, generator=g))


def dense(q, k, v, qpos, scale, window=0, softcap=0.0):
    """q (H, D) at position qpos over k, v (Hkv, L, D): plain attention, for one token."""
    h, hkv = q.shape[0], k.shape[0]
    k = k.repeat_interleave(h // hkv, 0)[:, : qpos + 1]
    v = v.repeat_interleave(h // hkv, 0)[:, : qpos + 1]
    s = torch.einsum("hd,hld->hl", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if window:
        s[:, : max(0, qpos + 1 - window)] = float("-inf")
    return torch.einsum("hl,hld->hd", s.softmax(-1), v)


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (5, 0.0), (0, 20.0), (3, 5.0)])
def test_reference_kernel_and_chunks_equal_dense_attention(window, softcap):
    kp, vp = pools()
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 11]], dtype=torch.int32)  # two rows, scattered blocks
    rows = torch.tensor([0, 0, 1, 1, 1], dtype=torch.int32)
    ctx = torch.tensor([1, 9, 4, 13, 16], dtype=torch.int32)
    q = torch.randn(5, 4, 8)  # 4 query heads over 2 kv heads
    ref = reference_token_attention(q, kp, vp, tables, rows, ctx, 16, 0.35, window, softcap)
    for t in range(5):
        blocks = tables[rows[t]].long()
        k = kp[blocks].transpose(0, 1).reshape(2, 16, 8)
        v = vp[blocks].transpose(0, 1).reshape(2, 16, 8)
        assert torch.allclose(ref[t], dense(q[t], k, v, int(ctx[t]) - 1, 0.35, window, softcap), atol=1e-5)
    kernel = load_cpu_kernel(wait=True)
    assert kernel is not None, "the CPU kernel does not build here"
    got = kernel.paged_attention(q, kp, vp, tables, rows, ctx, 0.35, window, softcap)
    assert torch.allclose(got, ref, atol=1e-5)
    # a chunk of row 1 at positions 3..15 through the gather + SDPA path
    chunk = torch.randn(13, 4, 8)
    out = chunk_attention(chunk, kp, vp, tables[1], 3, 0.35, window, softcap)
    per_token = reference_token_attention(chunk, kp, vp, tables, torch.ones(13, dtype=torch.int32),
                                          torch.arange(4, 17, dtype=torch.int32), 16, 0.35, window, softcap)
    assert torch.allclose(out, per_token, atol=1e-5)
