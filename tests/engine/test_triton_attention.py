"""The Triton attention kernels (the CUDA path) equal the torch references of engine.runner.attention.

Without CUDA they run under the Triton interpreter: TRITON_INTERPRET=1 is set here, before
triton is first imported, because triton fixes a kernel's mode when it is decorated (and the
engine on CPU never imports triton, so nothing else in the process is affected). Shapes are
tiny and tiles small (4-8 positions, so a row spans several tiles), as the interpreter is slow.
With CUDA the same cases run compiled with the real tile sizes, and the `gpu` test below adds
model-sized shapes in bf16 and fp8.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
if not CUDA and tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
    pytest.skip(f"the interpreter tests need triton >= 3.9 (3.6's interpreter fails on runtime loop bounds "
                f"under numpy 2; this is {triton.__version__})", allow_module_level=True)

from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.runner import attention  # noqa: E402
from engine.runner.attention import chunk_attention, reference_token_attention  # noqa: E402
from engine.runner.kernels import triton_attention as ta  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
ROOT = Path(__file__).resolve().parents[2]
if not CUDA and not ta.INTERPRETED:
    pytest.skip("triton was imported before this module without TRITON_INTERPRET=1 (run it on its own)",
                allow_module_level=True)
TILES = {} if CUDA else {"block_n": 4}
"""Small tiles under the interpreter; tl.dot on a GPU needs the real ones (>= 16)."""
CHUNK_TILES = {} if CUDA else {"block_m": 4, "block_n": 8}


def pools(num_blocks, hkv, bs, d, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(num_blocks, hkv, bs, d, generator=g) for _ in range(2))
    return k.to(DEVICE, dtype), v.to(DEVICE, dtype)


def scattered_tables(rows, width, num_blocks, seed=1):
    """Each row's blocks, distinct and out of order (block 0 unused: the tables' padding)."""
    perm = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed))[: rows * width] + 1
    return perm.view(rows, width).to(DEVICE, torch.int32)


def close(got, want, atol):
    assert got.dtype == want.dtype and got.shape == want.shape
    err = (got.float() - want.float()).abs().max().item()
    assert err <= atol, f"max abs error {err:.3g} > {atol}"


# (kv heads, query heads per kv head, head dim, splits, window, softcap)
DECODE_CASES = [
    (2, 1, 8, 1, 0, 0.0),     # MHA, one segment
    (2, 3, 24, 3, 0, 0.0),    # a group of 3 and a head dim of 24 (both padded and masked), split
    (1, 4, 8, 2, 5, 0.0),     # sliding window, split
    (2, 2, 16, 4, 0, 3.0),    # soft-capping; short rows leave segments empty
    (2, 4, 8, 1, 9, 2.0),     # window and soft-capping together
]


@pytest.mark.parametrize("hkv,groups,d,splits,window,softcap", DECODE_CASES)
def test_decode_kernel_equals_the_reference(hkv, groups, d, splits, window, softcap):
    bs, nb = 4, 24
    kp, vp = pools(nb, hkv, bs, d)
    tables = scattered_tables(2, 10, nb)
    rows = torch.tensor([0, 1, 1, 0, 1, 0], dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor([1, 37, 7, 30, 16, 4], dtype=torch.int32, device=DEVICE)  # ragged, a partial last block
    q = torch.randn(6, hkv * groups, d, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    want = reference_token_attention(q, kp, vp, tables, rows, ctx, 37, 0.3, window, softcap)
    got = ta.paged_decode(q, kp, vp, tables, rows, ctx, 37, 0.3, window, softcap, splits=splits, **TILES)
    close(got, want, 1e-5)


def test_decode_reads_each_row_only_within_its_length_and_window():
    """Every slot a token may not see holds NaN: a value read from one would poison the output
    (a key read there would be masked out of the scores, so values are what this catches)."""
    hkv, d, bs, nb = 2, 8, 4, 16
    kp, vp = pools(nb, hkv, bs, d)
    tables = scattered_tables(2, 6, nb)
    rows = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor([22, 9], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 4, d, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    want = reference_token_attention(q, kp, vp, tables, rows, ctx, 22, 0.3, 6)
    poisoned_k, poisoned_v = torch.full_like(kp, float("nan")), torch.full_like(vp, float("nan"))
    for r, n in enumerate(ctx.tolist()):
        for p in range(n - 6, n):  # the window: the only positions the row's token attends to
            b = tables[r, p // bs]
            poisoned_k[b, :, p % bs], poisoned_v[b, :, p % bs] = kp[b, :, p % bs], vp[b, :, p % bs]
    for splits in (1, 2):
        got = ta.paged_decode(q, poisoned_k, poisoned_v, tables, rows, ctx, 22, 0.3, 6, splits=splits, **TILES)
        close(got, want, 1e-5)


@pytest.mark.parametrize("q_dtype,kv_dtype,atol", [(torch.float32, torch.float8_e4m3fn, 1e-5),
                                                   (torch.bfloat16, torch.bfloat16, 2e-2),
                                                   (torch.bfloat16, torch.float8_e4m3fn, 2e-2)])
def test_decode_kernel_in_bf16_and_over_an_fp8_pool(q_dtype, kv_dtype, atol):
    hkv, d, bs, nb = 2, 16, 4, 20
    kp, vp = pools(nb, hkv, bs, d, dtype=kv_dtype)
    tables = scattered_tables(2, 8, nb)
    rows = torch.tensor([0, 1, 1], dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor([29, 3, 17], dtype=torch.int32, device=DEVICE)
    q = torch.randn(3, 4, d, generator=torch.Generator().manual_seed(4)).to(DEVICE, q_dtype)
    want = reference_token_attention(q, kp, vp, tables, rows, ctx, 29, 0.25)
    close(ta.paged_decode(q, kp, vp, tables, rows, ctx, 29, 0.25, splits=2, **TILES), want, atol)


def test_decode_with_the_default_tiles_and_head_dim_64():
    hkv, d, bs, nb = 2, 64, 16, 24
    kp, vp = pools(nb, hkv, bs, d)
    tables = scattered_tables(2, 10, nb)
    rows = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor([150, 70], dtype=torch.int32, device=DEVICE)  # 3 and 2 tiles of 64
    q = torch.randn(2, 8, d, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    want = reference_token_attention(q, kp, vp, tables, rows, ctx, 150, d ** -0.5)
    for splits in (None, 2):
        close(ta.paged_decode(q, kp, vp, tables, rows, ctx, 150, d ** -0.5, splits=splits), want, 1e-5)


def pass_with_chunks(hkv, groups, d, starts_counts, bs=4, nb=32, seed=6):
    """A packed pass: one decode token of row 0, then a chunk per (start, count) for rows 1.. —
    each after `start` positions already in the pool. Returns q, pools, tables, spans."""
    kp, vp = pools(nb, hkv, bs, d, seed)
    tables = scattered_tables(len(starts_counts) + 1, 8, nb)
    total = 1 + sum(c for _, c in starts_counts)
    q = torch.randn(total, hkv * groups, d, generator=torch.Generator().manual_seed(seed + 1)).to(DEVICE)
    spans, t = [], 1
    for r, (start, count) in enumerate(starts_counts, start=1):
        spans.append((t, t + count, r, start))
        t += count
    return q, kp, vp, tables, spans


@pytest.mark.parametrize("hkv,groups,d,window,softcap", [(2, 2, 8, 0, 0.0), (1, 3, 24, 0, 0.0),
                                                         (2, 1, 16, 6, 0.0), (2, 2, 8, 0, 4.0)])
def test_chunk_kernel_after_a_cached_prefix_equals_the_reference(hkv, groups, d, window, softcap):
    # chunk 1: 11 tokens after 13 cached positions (its last block partial); chunk 2: a first chunk
    q, kp, vp, tables, spans = pass_with_chunks(hkv, groups, d, [(13, 11), (0, 9)])
    out = torch.full_like(q, 7.0)
    ta.chunk_attention(q, kp, vp, tables, torch.tensor(spans, dtype=torch.int32, device=DEVICE), 11, out, 0.3,
                       window, softcap, **CHUNK_TILES)
    assert torch.all(out[0] == 7.0), "a token outside the chunks was written"
    for t0, t1, row, start in spans:
        want = chunk_attention(q[t0:t1], kp, vp, tables[row], start, 0.3, window, softcap)
        close(out[t0:t1], want, 1e-5)


def test_chunk_kernel_reads_nothing_after_the_chunk():
    """Slots after each chunk's last token hold NaN (not yet written in a real pool), and so does
    block 0, where masked table entries point."""
    q, kp, vp, tables, spans = pass_with_chunks(2, 2, 8, [(5, 10), (16, 6)])
    want = [chunk_attention(q[t0:t1], kp, vp, tables[row], start, 0.3) for t0, t1, row, start in spans]
    for t0, t1, row, start in spans:
        for p in range(start + t1 - t0, tables.shape[1] * 4):
            b = tables[row, p // 4]
            kp[b, :, p % 4] = vp[b, :, p % 4] = float("nan")
    kp[0] = vp[0] = float("nan")
    out = torch.empty_like(q)
    ta.chunk_attention(q, kp, vp, tables, torch.tensor(spans, dtype=torch.int32, device=DEVICE), 10, out, 0.3,
                       **CHUNK_TILES)
    for (t0, t1, _, _), w in zip(spans, want):
        close(out[t0:t1], w, 1e-5)


def test_chunk_kernel_with_the_default_tiles_and_head_dim_64():
    # 70 tokens after 50 cached: two query tiles of 64, the diagonal crossing key tiles
    q, kp, vp, tables, spans = pass_with_chunks(2, 2, 64, [(50, 70)], bs=16, nb=20)
    out = torch.empty_like(q)
    ta.chunk_attention(q, kp, vp, tables, torch.tensor(spans, dtype=torch.int32, device=DEVICE), 70, out, 0.125)
    close(out[1:], chunk_attention(q[1:], kp, vp, tables[1], 50, 0.125), 1e-5)


def test_split_count_fills_the_device_only_when_rows_are_few():
    assert ta.num_splits(256, 8, 4096, 132) == 1  # 2,048 programs: the GPU is full already
    assert ta.num_splits(4, 8, 4096, 132) == 9  # 32 programs: 9 segments of ~455 positions
    assert ta.num_splits(1, 1, 100_000, 132) == ta.MAX_SPLITS
    assert ta.num_splits(2, 8, 300, 132) == 1  # too short to be worth a second kernel


def test_the_kernels_compile_for_hopper_without_a_gpu():
    """The real compiler (not the interpreter) lowers Llama-3-8B's variants to sm_90 cubins."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_kernels.py"), "--quick", "--arch", "90"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.count("\nok ") == 4 and "0 failed" in out.stdout, out.stdout


@pytest.mark.skipif(CUDA, reason="on CUDA the engine takes the Triton path by itself (tests/engine/test_gpu.py)")
def test_the_engine_through_the_kernels_gives_the_torch_paths_tokens(tiny_model_dir, monkeypatch):
    """The dispatch of engine.runner.attention, run on CPU with the kernels standing in for CUDA's: a
    GQA model with soft-capping and sliding-window layers (Gemma 2), long prompts cut into
    chunks (the later ones after a cached prefix), short prompts through the per-token path,
    and decode, mixed in passes."""
    prompts = [[3 + i % 200 for i in range(96)], [9 + i % 100 for i in range(40)], list(range(20, 26))]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    config = EngineConfig(model=str(tiny_model_dir("gemma2")), device="cpu", max_batch_tokens=512,
                          max_num_seqs=4, max_num_batched_tokens=64, scheduling="continuous")
    monkeypatch.setattr(attention, "_KERNEL", [None])  # the torch reference, not the C++ kernel (built on use)
    want = [o.token_ids for o in LLMEngine(config).generate(prompts, params)]
    calls = {"paged_decode": 0, "chunk_attention": 0}
    chunk_starts = set()

    def counted(name):
        def run(*args, **kwargs):
            calls[name] += 1
            if name == "chunk_attention":
                chunk_starts.update(args[4][:, 3].tolist())  # spans: the position each chunk starts at
            return getattr(ta, name)(*args, **kwargs)
        return run

    kernels = type("Kernels", (), {name: staticmethod(counted(name)) for name in calls})
    monkeypatch.setattr(attention, "_triton_kernels", lambda q: kernels)
    got = [o.token_ids for o in LLMEngine(config).generate(prompts, params)]
    assert got == want
    assert calls["paged_decode"] and calls["chunk_attention"], calls
    assert max(chunk_starts) > 0, "no chunk followed a cached prefix"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,kv_dtype,atol", [(torch.float32, None, 1e-4), (torch.bfloat16, None, 2e-2),
                                                 (torch.bfloat16, torch.float8_e4m3fn, 2e-2)])
def test_kernels_at_model_shapes_on_cuda(dtype, kv_dtype, atol):
    """Llama-3-8B's attention shape (32 query / 8 KV heads of 128), 16-token blocks: decode over
    ragged rows up to 3,000 positions (split), and a 300-token chunk after a 700-token prefix."""
    hkv, d, bs, nb = 8, 128, 16, 800
    kp, vp = pools(nb, hkv, bs, d, dtype=kv_dtype or dtype)
    tables = scattered_tables(4, 190, nb)
    rows = torch.arange(4, dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor([3000, 1, 1234, 17], dtype=torch.int32, device=DEVICE)
    q = torch.randn(4, 32, d, device=DEVICE, dtype=dtype)
    want = reference_token_attention(q, kp, vp, tables, rows, ctx, 3000, d ** -0.5)
    close(ta.paged_decode(q, kp, vp, tables, rows, ctx, 3000, d ** -0.5), want, atol)
    assert ta.num_splits(4, hkv, 3000, ta.sm_count(q.device)) > 1
    qc = torch.randn(300, 32, d, device=DEVICE, dtype=dtype)
    out = torch.empty_like(qc)
    spans = torch.tensor([[0, 300, 2, 700]], dtype=torch.int32, device=DEVICE)
    ta.chunk_attention(qc, kp, vp, tables, spans, 300, out, d ** -0.5)
    close(out, chunk_attention(qc, kp, vp, tables[2], 700, d ** -0.5), atol)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability() < (8, 9), reason="fp8 needs compute capability >= 8.9")
def test_an_fp8_pool_agrees_with_bf16_through_the_engine(tiny_model_dir):
    """kv_cache_dtype fp8 against auto (bf16), greedy, through the kernels: prints the agreement."""
    prompts = [[3 + (i * 7 + j) % 250 for j in range(20 + 9 * i)] for i in range(8)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    runs = {}
    for kv in ("auto", "fp8"):
        llm = LLMEngine(EngineConfig(model=str(tiny_model_dir("llama")), device="cuda", dtype="bfloat16",
                                     kv_cache_dtype=kv, max_batch_tokens=2048, max_num_seqs=8))
        runs[kv] = [o.token_ids for o in llm.generate(prompts, params)]
    same = sum(a == b for a, b in zip(runs["auto"], runs["fp8"]))
    first = sum(a[0] == b[0] for a, b in zip(runs["auto"], runs["fp8"]))
    print(f"fp8 KV vs bf16: {same}/{len(prompts)} requests identical, {first}/{len(prompts)} first tokens")
    assert first >= len(prompts) // 2  # a broken fp8 read would agree by chance only (1 in 259)
