"""Triton kernels for attention over the paged KV pool: the CUDA path of `engine.runner.attention`.

Both read keys and values in place from the pool, (num_blocks, Hkv, block_size, D), through
each row's block table; nothing is gathered into a contiguous copy and K/V are never repeated
for GQA. fp8 pools (`kv_cache_dtype: fp8`, unscaled e4m3 as `engine.runner.kv_cache` stores them) are
converted to the query's dtype on load. Scores are float32; soft-capping and sliding windows
follow `engine.runner.attention.reference_token_attention` exactly (a token at ctx - 1 sees positions
[ctx - window, ctx)).

- `paged_decode`: one program per (token, KV head, KV segment). The G query heads of a KV head
  are packed into one tile, so each key and value is read once for all of them. A token reads
  only its own [lo, ctx). When tokens x KV heads are too few to fill the GPU, each token's
  range is cut into segments (flash-decoding): each program keeps a partial softmax (max, sum,
  accumulator) and a second small kernel merges the segments by their log-sum-exp.
- `chunk_attention`: the long prefill chunks of a pass in one launch; one program per (query
  tile, chunk, query head). A chunk's queries at positions start..start+count attend causally
  to the row's earlier positions (a cached prefix in the pool) and to the chunk itself. Key
  tiles after a query tile's last position, or before its window, are never visited; tiles
  crossing the diagonal or the window edge are masked.

Tested against the torch references on CPU under TRITON_INTERPRET=1
(tests/engine/test_triton_attention.py), and on CUDA by the `gpu` tests.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CUDA build of torch brings triton; engine.runner.attention keeps the torch paths without it
    raise ImportError("engine.runner.kernels.triton_attention needs triton: a CUDA build of torch brings it, "
                      "or pip install 'batchinfer[kernels]'") from None

# Tiles. Every tl.dot operand dimension is at least 16 (the GPU's MMA tile); head dims that
# are not a power of two (80, 96) are padded up and masked. The sizes are the largest for which
# ptxas reports no register spills on sm_90 (H100/H200) in bf16 at head dims 64, 128 and 256 with
# triton 3.9 (4 warps, or a 128 x 64 prefill tile, spilled); scripts/compile_kernels.py prints
# them (prefill at head dim 96 and in fp32 at 128 still spills a little). Not yet timed on a GPU.
DECODE_TILES = {128: (64, 8), 256: (32, 8)}
"""Padded head dim up to -> (key positions per decode tile, warps)."""
DECODE_MIN_HEADS = 16
"""A decode tile's query-head rows: the GQA group padded up to this (tl.dot's smallest M)."""
SPLIT_MIN_TOKENS = 256
"""A KV segment of flash-decoding covers at least this many positions of the longest row."""
MAX_SPLITS = 16
SPLIT_WAVES = 2
"""Split until tokens x KV heads x segments reach this many programs per SM."""
CHUNK_TILES = {128: (64, 64, 8), 256: (32, 32, 8)}
"""Padded head dim up to -> (query tokens, key positions per prefill tile, warps)."""
STAGES = 2
"""Software-pipelining stages of both kernels' key/value loads."""


@triton.jit
def _pool_tile(POOL, table, pos, pmask, kvh, offs_d, dmask, stride_b, stride_h, stride_s, BS: tl.constexpr,
               dtype: tl.constexpr):
    """Keys or values of positions `pos` (BLOCK_N,) of one row from the pool, through its block
    table: (BLOCK_N, BLOCK_D) in `dtype`, zero where masked."""
    blk = tl.load(table + pos // BS, mask=pmask, other=0).to(tl.int64)
    addr = POOL + blk[:, None] * stride_b + kvh * stride_h + (pos % BS)[:, None] * stride_s + offs_d[None, :]
    return tl.load(addr, mask=pmask[:, None] & dmask[None, :], other=0.0).to(dtype)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with fp32 accumulation. UPCAST (under the interpreter, whose tl.dot multiplies bf16
    bit patterns as integers): through fp32, exact for bf16/fp16 operands."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=PRECISION)
    return out


@triton.jit
def _scores(q, k, scale, softcap, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Scores of query rows q against key tile k, (rows, BLOCK_N) fp32, soft-capped when SOFTCAP
    (softcap * tanh(s / softcap), through exp: tl has no tanh)."""
    s = _dot(q, tl.trans(k), PRECISION, UPCAST) * scale
    if SOFTCAP:
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
    return s


@triton.jit
def _softmax_step(m_i, l_i, acc, s, v, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One key tile of the online softmax: the running max m_i, sum l_i and accumulator acc of
    each query row, updated with the tile's scores s (-inf where masked) and values v. A row may
    see nothing in a tile (before its window): its max stays -inf and its p 0."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _decode_kernel(Q, K, V, TABLES, ROWS, CTX, OUT, PART_O, PART_LSE,
                   stride_qt, stride_qh, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                   stride_bt, stride_ot, stride_oh, scale, softcap, window, num_splits, H,
                   G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
                   WINDOW: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(ROWS + t)
    hi = tl.load(CTX + t)
    lo = 0
    if WINDOW:
        lo = tl.maximum(hi - window, 0)
    # this program's segment of [lo, hi), a whole number of tiles long
    seg = tl.cdiv(tl.cdiv(hi - lo, num_splits), BLOCK_N) * BLOCK_N
    seg_lo = lo + split * seg
    seg_hi = tl.minimum(seg_lo + seg, hi)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    head = kvh * G + offs_h  # (BLOCK_H,) query heads of this KV head
    hmask = offs_h < G
    dmask = offs_d < D
    q = tl.load(Q + t * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0)  # (BLOCK_H, BLOCK_D)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table = TABLES + row.to(tl.int64) * stride_bt
    for start in range(seg_lo, seg_hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pmask = pos < seg_hi
        k = _pool_tile(K, table, pos, pmask, kvh, offs_d, dmask, stride_kb, stride_kh, stride_ks, BS, q.dtype)
        s = _scores(q, k, scale, softcap, SOFTCAP, PRECISION, UPCAST)  # (BLOCK_H, BLOCK_N)
        s = tl.where(pmask[None, :], s, float("-inf"))
        v = _pool_tile(V, table, pos, pmask, kvh, offs_d, dmask, stride_vb, stride_vh, stride_vs, BS, q.dtype)
        m_i, l_i, acc = _softmax_step(m_i, l_i, acc, s, v, PRECISION, UPCAST)
    if SPLIT:
        # an empty segment (a row shorter than the others) leaves lse = -inf: weight 0 in the merge
        part = (t * H + head) * num_splits + split  # (BLOCK_H,)
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        tl.store(PART_O + part[:, None] * D + offs_d[None, :], acc / l_safe[:, None],
                 mask=hmask[:, None] & dmask[None, :])
        tl.store(PART_LSE + part, tl.where(l_i > 0, m_i + tl.log(l_safe), float("-inf")), mask=hmask)
    else:
        o = acc / l_i[:, None]
        tl.store(OUT + t * stride_ot + head[:, None] * stride_oh + offs_d[None, :], o.to(OUT.dtype.element_ty),
                 mask=hmask[:, None] & dmask[None, :])


@triton.jit
def _merge_kernel(PART_O, PART_LSE, OUT, stride_ot, stride_oh, num_splits, H,
                  D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    smask = offs_s < num_splits
    base = (t * H + h) * num_splits
    lse = tl.load(PART_LSE + base + offs_s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)  # finite: the first segment of a row is never empty
    w = tl.exp(lse - m)
    o = tl.load(PART_O + (base + offs_s)[:, None] * D + offs_d[None, :],
                mask=smask[:, None] & (offs_d[None, :] < D), other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(OUT + t * stride_ot + h * stride_oh + offs_d, out.to(OUT.dtype.element_ty), mask=offs_d < D)


@triton.jit
def _chunk_kernel(Q, K, V, TABLES, SPANS, OUT,
                  stride_qt, stride_qh, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                  stride_bt, stride_ot, stride_oh, scale, softcap, window,
                  G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
                  PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    tile = tl.program_id(0)
    c = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // G
    t0 = tl.load(SPANS + c * 4)
    count = tl.load(SPANS + c * 4 + 1) - t0
    row = tl.load(SPANS + c * 4 + 2)
    pos0 = tl.load(SPANS + c * 4 + 3)
    m0 = tile * BLOCK_M
    if m0 >= count:  # the grid is sized for the longest chunk
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mmask = offs_m < count
    dmask = offs_d < D
    qpos = pos0 + offs_m
    q = tl.load(Q + (t0 + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=mmask[:, None] & dmask[None, :], other=0.0)  # (BLOCK_M, BLOCK_D)
    hi = pos0 + tl.minimum(m0 + BLOCK_M, count)  # the tile's last query position + 1
    lo = 0
    if WINDOW:
        lo = (tl.maximum(pos0 + m0 - window + 1, 0) // BLOCK_N) * BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = TABLES + row.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        kmask = kpos < hi
        k = _pool_tile(K, table, kpos, kmask, kvh, offs_d, dmask, stride_kb, stride_kh, stride_ks, BS, q.dtype)
        s = _scores(q, k, scale, softcap, SOFTCAP, PRECISION, UPCAST)  # (BLOCK_M, BLOCK_N)
        valid = kmask[None, :] & (kpos[None, :] <= qpos[:, None])
        if WINDOW:
            valid = valid & (kpos[None, :] > qpos[:, None] - window)
        s = tl.where(valid, s, float("-inf"))
        v = _pool_tile(V, table, kpos, kmask, kvh, offs_d, dmask, stride_vb, stride_vh, stride_vs, BS, q.dtype)
        m_i, l_i, acc = _softmax_step(m_i, l_i, acc, s, v, PRECISION, UPCAST)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(OUT + (t0 + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             o.to(OUT.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


# -- launchers ------------------------------------------------------------------------------

INTERPRETED = type(_decode_kernel).__name__ == "InterpretedFunction"
"""The kernels run under the Triton interpreter (TRITON_INTERPRET=1 when triton was imported)."""

_SM_COUNT: dict = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere: the interpreter runs serially)."""
    if device.type != "cuda":
        return 1
    if device not in _SM_COUNT:
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device]


def num_splits(tokens: int, kv_heads: int, max_ctx: int, sms: int) -> int:
    """KV segments per token: enough programs for SPLIT_WAVES per SM, each segment at least
    SPLIT_MIN_TOKENS of the longest row, at most MAX_SPLITS."""
    programs = tokens * kv_heads
    if programs >= SPLIT_WAVES * sms:
        return 1
    want = -(-SPLIT_WAVES * sms // programs)
    return max(1, min(want, max_ctx // SPLIT_MIN_TOKENS, MAX_SPLITS))


def _precision(dtype: torch.dtype) -> str:
    # fp32 models keep fp32 products (parity with transformers); tf32 would round them
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _tiles(table: dict, d: int) -> tuple:
    return next((tiles for most, tiles in sorted(table.items()) if _block_d(d) <= most), table[max(table)])


def decode_warps(d: int) -> int:
    return _tiles(DECODE_TILES, d)[1]


def chunk_warps(d: int) -> int:
    return _tiles(CHUNK_TILES, d)[2]


def decode_constants(dtype: torch.dtype, groups: int, d: int, block_size: int, split: bool, window: int,
                     softcap: float, block_n: int | None = None) -> dict:
    """The decode kernel's compile-time arguments (one compiled variant per distinct dict)."""
    block_n = block_n or _tiles(DECODE_TILES, d)[0]
    return dict(G=groups, D=d, BS=block_size, BLOCK_H=max(DECODE_MIN_HEADS, triton.next_power_of_2(groups)),
                BLOCK_D=_block_d(d), BLOCK_N=block_n, SOFTCAP=bool(softcap), WINDOW=bool(window), SPLIT=split,
                PRECISION=_precision(dtype), UPCAST=INTERPRETED)


def chunk_constants(dtype: torch.dtype, groups: int, d: int, block_size: int, window: int, softcap: float,
                    block_m: int | None = None, block_n: int | None = None) -> dict:
    """The chunk kernel's compile-time arguments."""
    tile_m, tile_n, _ = _tiles(CHUNK_TILES, d)
    if dtype == torch.float32:
        tile_m //= 2  # operands of twice the bytes (fp32 parity runs, not the fast path)
    block_m, block_n = block_m or tile_m, block_n or tile_n
    return dict(G=groups, D=d, BS=block_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_block_d(d),
                SOFTCAP=bool(softcap), WINDOW=bool(window), PRECISION=_precision(dtype), UPCAST=INTERPRETED)


def _strides(k_pool, v_pool):
    assert k_pool.stride(-1) == 1 and v_pool.stride(-1) == 1
    return (*k_pool.stride()[:3], *v_pool.stride()[:3])


def paged_decode(q, k_pool, v_pool, block_tables, token_row, ctx, max_ctx: int, scale: float, window: int = 0,
                 softcap: float = 0.0, *, splits: int | None = None, block_n: int | None = None):
    """q (T, H, D); pools (num_blocks, Hkv, block_size, D); block_tables (R, max_blocks) int32;
    token_row, ctx (T,) int32 -> (T, H, D): token t over positions [ctx - window, ctx) of its row
    (`reference_token_attention`'s contract). `splits` None: chosen for the device."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    t, h, d = q.shape
    hkv, bs = k_pool.shape[1], k_pool.shape[2]
    g = h // hkv
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    if splits is None:
        splits = num_splits(t, hkv, max_ctx, sm_count(q.device))
    if splits > 1:
        part_o = torch.empty((t, h, splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((t, h, splits), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    _decode_kernel[(t, hkv, splits)](
        q, k_pool, v_pool, block_tables, token_row, ctx, out, part_o, part_lse,
        q.stride(0), q.stride(1), *_strides(k_pool, v_pool), block_tables.stride(0), out.stride(0), out.stride(1),
        float(scale), float(softcap or 1.0), int(window), splits, h,
        **decode_constants(q.dtype, g, d, bs, splits > 1, window, softcap, block_n), num_warps=decode_warps(d),
        num_stages=STAGES)
    if splits > 1:
        _merge_kernel[(t, h)](part_o, part_lse, out, out.stride(0), out.stride(1), splits, h,
                              D=d, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=_block_d(d))
    return out


def chunk_attention(q, k_pool, v_pool, block_tables, spans, max_count: int, out, scale: float, window: int = 0,
                    softcap: float = 0.0, *, block_m: int | None = None, block_n: int | None = None):
    """Writes out[first:end] for every chunk. q, out (T, H, D); spans (C, 4) int32 on q's device:
    (first token, end token, row, position of the first token) per chunk (`PassMetadata.chunks`);
    max_count: the longest chunk's tokens. A chunk's tokens attend to positions
    [0, position + 1) of their row, within the window."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    assert out.stride(-1) == 1
    _, h, d = q.shape
    hkv, bs = k_pool.shape[1], k_pool.shape[2]
    if not spans.shape[0] or not max_count:
        return out
    constants = chunk_constants(q.dtype, h // hkv, d, bs, window, softcap, block_m, block_n)
    _chunk_kernel[(triton.cdiv(max_count, constants["BLOCK_M"]), spans.shape[0], h)](
        q, k_pool, v_pool, block_tables, spans, out,
        q.stride(0), q.stride(1), *_strides(k_pool, v_pool), block_tables.stride(0), out.stride(0), out.stride(1),
        float(scale), float(softcap or 1.0), int(window), **constants, num_warps=chunk_warps(d),
        num_stages=STAGES)
    return out
