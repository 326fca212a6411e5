"""Prefix caching on the paged pool: shared prompt blocks computed once and held once (every
row that has them references the same blocks); results equal caching off."""
from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.api.config import SCHEDULING_MODES
from engine.core.block_pool import BlockPool, chain_hashes, hash_salt
from test_parity import assert_same_tokens, reference

PREFIX = "Label the sentiment of the review as positive or negative. Review:"  # 66 bytes: ends mid-block
REVIEWS = [" great film", " awful, just awful", " fine I guess", " loved every minute of it", " meh", " no"]
BLOCK_SIZE = 16
SALT = hash_salt("m", None, "float32")


def block_hashes(tokens, limit=None):
    return chain_hashes(tokens, BLOCK_SIZE, SALT, limit)


def engine(path, on: bool, mode: str = "static", **kw) -> LLMEngine:
    settings = dict(model=str(path), max_batch_tokens=2048, max_num_seqs=8, scheduling=mode,
                    enable_prefix_caching=on)
    return LLMEngine(EngineConfig(**{**settings, **kw}))


def test_block_hashes_name_the_whole_prefix():
    a = list(range(40))
    b = list(range(40))
    b[3] = 999  # differs in the first block: every later block's name differs too
    assert len(block_hashes(a)) == 40 // BLOCK_SIZE
    assert block_hashes(a)[0] == block_hashes(a[:16])[0]
    assert not set(block_hashes(a)) & set(block_hashes(b))
    assert block_hashes(a, limit=31) == block_hashes(a)[:1]
    assert all(len(h) == 32 for h in block_hashes(a))  # sha256: no 64-bit collisions
    # another model, revision or dtype names the same tokens differently
    assert not set(chain_hashes(a, BLOCK_SIZE, hash_salt("m", None, "bfloat16"))) & set(block_hashes(a))
    assert not set(chain_hashes(a, BLOCK_SIZE, hash_salt("m", "v2", "float32"))) & set(block_hashes(a))


def test_freed_chains_are_evicted_tail_first_and_unnamed_blocks_reused_first():
    pool = BlockPool(num_blocks=6, block_size=4)
    chain = pool.allocate(3)
    names = [b"a", b"b", b"c"]
    for blk, name in zip(chain, names):
        pool.name(blk, name)
    scratch = pool.allocate(1)
    pool.release(chain)
    pool.release(scratch)
    # the unnamed block goes first, then free never-named blocks, then the chain's tail, its head last
    order = pool.allocate(6)
    assert order[0] == scratch[0]
    assert order.index(chain[2]) < order.index(chain[1]) < order.index(chain[0])
    assert pool.match(names) == []  # all evicted


def test_shared_blocks_are_referenced_not_copied():
    pool = BlockPool(num_blocks=8, block_size=4)
    first = pool.allocate(2)
    pool.name(first[0], b"x"), pool.name(first[1], b"y")
    found = pool.match([b"x", b"y", b"z"])
    assert found == first
    pool.take_cached(found)
    assert [pool.refs[b] for b in first] == [2, 2] and pool.num_free == 6
    pool.release(first)
    pool.release(found)
    assert pool.num_free == 8 and pool.match([b"x", b"y"]) == first  # unreferenced, still cached


@pytest.mark.parametrize("mode", SCHEDULING_MODES)
def test_greedy_tokens_equal_caching_off_and_transformers(mode, tiny_model_dir, reference_model, forgiveness):
    path = tiny_model_dir("llama")
    prompts = [PREFIX + r for r in REVIEWS]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    on, off = engine(path, True, mode), engine(path, False, mode)
    got_on, got_off = on.generate(prompts, params), off.generate(prompts, params)
    ref_model = reference_model(path)
    for p, a, b in zip(prompts, got_on, got_off):
        ref, logits = reference(ref_model, on.tokenizer.encode(p), 12, stop_at_eos=False)
        assert_same_tokens(a.token_ids, ref, logits, f"cached {mode} {p[-12:]!r}", forgiveness)
        assert_same_tokens(b.token_ids, ref, logits, f"uncached {mode} {p[-12:]!r}", forgiveness)
    cached = sum(s.cached_prompt_tokens for s in on.batch_stats)
    shared_blocks = len(on.tokenizer.encode(PREFIX)) // BLOCK_SIZE * BLOCK_SIZE
    assert cached == shared_blocks * (len(prompts) - 1)  # every row but the first reuses the prefix
    assert sum(s.cached_prompt_tokens for s in off.batch_stats) == 0


def test_a_prefix_is_reused_across_generate_calls(tiny_model_dir):
    llm = engine(tiny_model_dir("llama"), True)
    params = SamplingParams(max_tokens=4, temperature=0)
    llm.generate([PREFIX + REVIEWS[0]], params)
    assert llm.batch_stats[-1].cached_prompt_tokens == 0
    llm.generate([PREFIX + REVIEWS[1]], params)
    assert llm.batch_stats[-1].cached_prompt_tokens > 0
    assert llm.prefix_cache_hit_rate > 0


def test_rows_that_share_nothing_hit_nothing_and_are_unchanged(tiny_model_dir):
    path = tiny_model_dir("llama")
    prompts = [f"{i}: " + chr(65 + i) * (20 + i) for i in range(6)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    on = engine(path, True)
    assert [o.token_ids for o in on.generate(prompts, params)] == \
        [o.token_ids for o in engine(path, False).generate(prompts, params)]
    assert sum(s.cached_prompt_tokens for s in on.batch_stats) == 0


def test_more_prefixes_than_the_pool_keeps_evicts_and_stays_correct(tiny_model_dir):
    """A pool of 8 blocks and 6 distinct 3-block prefixes, each used twice: freed blocks are
    reused least recently freed first, and every result equals caching off."""
    path = tiny_model_dir("llama")
    prefixes = [f"prefix {i} " + chr(97 + i) * 40 for i in range(6)]
    prompts = [p + s for s in (" one", " two") for p in prefixes]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    on = engine(path, True, max_num_seqs=1, max_batch_tokens=8 * BLOCK_SIZE)
    got = [o.token_ids for o in on.generate(prompts, params)]
    assert got == [o.token_ids for o in engine(path, False, max_num_seqs=1).generate(prompts, params)]
    assert len(on.pool.cached) <= 8
    # each prefix is evicted before its second use comes round: nothing reusable survived
    assert on.pool.hit_tokens == 0
    on.generate([prompts[-1]], params)  # but the most recent prefix is still there
    assert on.batch_stats[-1].cached_prompt_tokens > 0


def test_prefix_cache_tokens_is_accepted_and_ignored_with_a_warning(tiny_model_dir):
    with pytest.warns(DeprecationWarning, match="ignored"):
        config = EngineConfig(model="builtin:tiny", prefix_cache_tokens=64)
    assert LLMEngine(config).pool_tokens == 8192


def test_rows_sharing_a_prefix_hold_it_once_in_the_pool(tiny_model_dir):
    """64 rows after one 384-token prefix fit a 2,048-token pool together (copied per row they
    would need 25,000 tokens): the prefix's 24 blocks are held once, by every row."""
    llm = engine(tiny_model_dir("llama"), True, max_batch_tokens=2048, max_num_seqs=64)
    prefix = [1] + [3 + i % 200 for i in range(383)]
    prompts = [prefix + [210 + i % 40, 211] for i in range(64)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert all(o.finish_reason == "length" for o in outs)
    st = llm.batch_stats[0]
    assert st.peak_rows == 64 and st.preemptions == 0
    assert st.cached_prompt_tokens == 63 * 384 and st.reserved_tokens <= 2048


def test_seeded_sampling_gives_the_same_tokens_with_caching_on_or_off(tiny_model_dir):
    path = tiny_model_dir("llama")
    prompts = [PREFIX + r for r in REVIEWS]
    params = [SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=100 + i) for i in range(len(prompts))]
    on = [o.token_ids for o in engine(path, True, "continuous").generate(prompts, params)]
    off = [o.token_ids for o in engine(path, False, "continuous").generate(prompts, params)]
    assert on == off


def test_choice_scores_equal_caching_off(tiny_model_dir):
    path = tiny_model_dir("llama")
    prompts = [PREFIX + r + " Sentiment:" for r in REVIEWS]
    choices = [[" positive", " negative", " neutral"]] * len(prompts)
    on = engine(path, True)
    got = on.score_choices(prompts, choices)
    want = engine(path, False).score_choices(prompts, choices)
    for a, b in zip(got, want):
        assert a.error is None and a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert on.prefix_cache_hit_rate > 0.5


def test_identical_prompts_whose_length_is_a_multiple_of_the_block_share_one_prefill(tiny_model_dir):
    """The block holding the last prompt token is never cached, so it must not make identical
    prompts wait for each other: one row computes the shared blocks, the rest then join together."""
    llm = engine(tiny_model_dir("llama"), True, max_num_batched_tokens=4096)
    prompt = [1] + [40 + i % 50 for i in range(2 * BLOCK_SIZE - 1)]  # exactly 2 blocks
    outs = llm.generate([prompt] * 8, SamplingParams(max_tokens=3, temperature=0))
    assert len({tuple(o.token_ids) for o in outs}) == 1
    assert llm.batch_stats[0].prefill_steps <= 2
    assert llm.batch_stats[0].cached_prompt_tokens == 7 * BLOCK_SIZE  # the last block is computed by each row


def test_cached_tokens_count_each_prompt_once_per_request_and_sample(tiny_model_dir):
    """n samples share their prompt's blocks: the sample that computes the prompt finds nothing
    cached, its siblings find every full block; each Completion and Sample says so, and the
    batch's cached tokens never exceed its prompt tokens."""
    llm = engine(tiny_model_dir("llama"), True, "continuous", max_num_batched_tokens=4096)
    prompt = [1] + [40 + i % 50 for i in range(3 * BLOCK_SIZE + 4)]  # 3 full blocks and a partial one
    out = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=1.0, seed=3, n=4))[0]
    assert sorted(s.num_cached_tokens for s in out.samples) == [0] + [3 * BLOCK_SIZE] * 3
    assert out.num_cached_tokens == out.samples[0].num_cached_tokens
    st = llm.batch_stats[0]
    assert st.cached_prompt_tokens == 3 * 3 * BLOCK_SIZE <= st.prompt_tokens


def test_a_recompute_after_preemption_is_not_a_prefix_cache_hit(tiny_model_dir):
    """A preempted row that comes back finds its own blocks still cached; that is its own work
    kept, not a prompt served by the cache, so the rows' cached tokens stay within their prompts."""
    llm = engine(tiny_model_dir("llama"), True, "continuous", max_batch_tokens=1024, max_num_seqs=16)
    prompts = [[1] + [3 + (7 * i + j) % 250 for j in range(40)] for i in range(16)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    stats = llm.batch_stats
    assert sum(s.preemptions for s in stats) > 0
    assert llm.pool.hit_tokens > 0  # the recomputes did find blocks cached
    assert sum(s.cached_prompt_tokens for s in stats) == sum(o.num_cached_tokens for o in outs) == 0
