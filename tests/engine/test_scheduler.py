"""The scheduler over the block pool, fed by hand (no model): admission on demand, chunked
prefill under the pass budget, preemption of the most recently admitted row, static cohorts."""
from __future__ import annotations

from engine.api.sampling_params import SamplingParams
from engine.core.block_pool import BlockPool
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence, Status


def seq(i: int, prompt: int, max_tokens: int = 8) -> Sequence:
    return Sequence(index=i, prompt_token_ids=[100 + i] * prompt, params=SamplingParams(max_tokens=max_tokens), seed=0)


def scheduler(blocks: int, rows: int = 64, batched: int = 1024, continuous: bool = True, caching: bool = False):
    return Scheduler(BlockPool(blocks, 4, caching=caching), rows, max_model_len=4096,
                     max_num_batched_tokens=batched, continuous=continuous)


def run(s: Scheduler, step, sample_token: int = 7) -> list[Sequence]:
    """What the engine does after a pass: tokens computed, one sampled per finished chunk,
    rows at max_tokens finished."""
    s.update(step)
    done = []
    for c in step.chunks:
        if c.samples:
            c.seq.output_token_ids.append(sample_token)
            if c.seq.num_output_tokens >= c.seq.params.max_tokens:
                c.seq.finish("length")
                done.append(c.seq)
    s.finish(done)
    return done


def test_rows_are_admitted_for_what_they_need_now_not_prompt_plus_max_tokens():
    # 8-token prompts, max_tokens 500: 3 blocks of 4 each now (prompt + next token), not 127
    s = scheduler(blocks=40)
    for i in range(10):
        s.add(seq(i, 8, max_tokens=100))
    step = s.schedule()
    assert len(step.admitted) == 10 and all(len(q.block_ids) == 3 for q in step.admitted)
    assert step.num_tokens == 80 and all(c.samples for c in step.chunks)


def test_long_prompts_are_cut_into_chunks_and_decode_rows_go_first():
    s = scheduler(blocks=200, batched=32)
    s.add(seq(0, 10))
    run(s, s.schedule())  # row 0 prefilled and sampled
    s.add(seq(1, 70))
    step = s.schedule()
    assert [(c.seq.index, c.start, c.count) for c in step.chunks] == [(0, 10, 1), (1, 0, 31)]
    assert not step.chunks[1].samples
    run(s, step)
    step = s.schedule()
    assert [(c.seq.index, c.start, c.count) for c in step.chunks] == [(0, 11, 1), (1, 31, 31)]
    run(s, step)
    step = s.schedule()
    assert [(c.seq.index, c.start, c.count) for c in step.chunks] == [(0, 12, 1), (1, 62, 8)] and step.chunks[1].samples


def test_when_the_pool_runs_out_the_most_recently_admitted_row_is_preempted_and_resumed():
    s = scheduler(blocks=6)
    a, b = seq(0, 8, max_tokens=12), seq(1, 8, max_tokens=12)
    s.add(a), s.add(b)
    step = s.schedule()
    assert step.admitted == [a, b]  # 3 blocks each: the pool is full
    run(s, step)
    preempted = []
    while s.has_work():
        step = s.schedule()
        preempted += step.preempted
        run(s, step)
    assert preempted and preempted[0] is b and a.preemptions == 0 and b.preemptions >= 1
    assert a.num_output_tokens == 12 and b.num_output_tokens == 12
    assert s.pool.num_free == 6 and s.preemptions == len(preempted)


def test_a_preempted_row_comes_back_with_its_output_as_prompt():
    s = scheduler(blocks=6)
    a, b = seq(0, 8, max_tokens=12), seq(1, 8, max_tokens=12)
    s.add(a), s.add(b)
    run(s, s.schedule())
    while not b.preemptions:
        run(s, s.schedule())
    assert b.status is Status.WAITING and b.block_ids == [] and b.num_computed_tokens == 0
    kept = b.num_output_tokens
    while b.status is not Status.RUNNING:
        step = s.schedule()
        run(s, step)
    back = next(c for c in step.chunks if c.seq is b)
    assert back.start == 0 and back.count == 8 + kept  # prompt and output so far, recomputed


def test_static_batches_admit_no_new_row_until_they_drain():
    s = scheduler(blocks=100, rows=2, continuous=False)
    rows = [seq(i, 8, max_tokens=2 + i) for i in range(3)]
    for r in rows:
        s.add(r)
    first = s.schedule()
    assert len(first.admitted) == 2
    run(s, first)
    seen = set()
    while s.has_work():
        step = s.schedule()
        if step.admitted:
            seen.add(step.admitted[0].index)
            assert not s.running[:-1] or all(q.status is Status.RUNNING for q in s.running)
            assert len(s.running) == 1  # the third joins only once the first batch drained
        run(s, step)
    assert seen == {0}  # longest first: rows 2 and 1 formed the first batch


def test_requests_that_can_never_fit_fail_with_the_limit_named():
    s = scheduler(blocks=8)  # 32 tokens
    big = seq(0, 30, max_tokens=8)
    assert not s.add(big) and "max_batch_tokens (32)" in big.error
    long = Scheduler(BlockPool(100, 4), 8, max_model_len=16, max_num_batched_tokens=64)
    r = seq(1, 10, max_tokens=8)
    assert not long.add(r) and "max_model_len (16)" in r.error
    empty = Sequence(index=2, prompt_token_ids=[], params=SamplingParams(), seed=0)
    assert not s.add(empty) and "empty prompt" in empty.error


def test_rows_sharing_an_uncomputed_prefix_wait_for_the_first_to_compute_it():
    s = scheduler(blocks=100, caching=True)
    shared = [5] * 16
    rows = [Sequence(index=i, prompt_token_ids=shared + [i, i], params=SamplingParams(max_tokens=4), seed=0)
            for i in range(3)]
    for r in rows:
        s.add(r)
    step = s.schedule()
    assert len(step.admitted) == 1
    run(s, step)
    step = s.schedule()  # the prefix is named now: the others take its blocks
    others = [r for r in step.admitted]
    assert len(others) == 2 and all(r.num_computed_tokens == 16 for r in others)
    first = step.chunks[0].seq
    assert all(r.block_ids[:4] == first.block_ids[:4] for r in others)
    assert all(s.pool.refs[b] == 3 for b in first.block_ids[:4])


def test_with_caching_off_rows_sharing_a_first_block_are_admitted_together():
    """Without prefix caching nothing is shared, so there is nothing to wait for: identical
    prompts (n samples, a shared system prompt) run together, not one after another."""
    for caching, admitted in ((True, [1, 3]), (False, [4])):
        s = scheduler(blocks=100, caching=caching)
        for i in range(4):
            s.add(Sequence(index=i, prompt_token_ids=[5] * 9, params=SamplingParams(max_tokens=4), seed=0))
        step = s.schedule()
        counts = [len(step.admitted)]
        run(s, step)
        step = s.schedule()
        counts += [len(step.admitted)] if step.admitted else []
        assert counts == admitted, caching
        assert not s.inflight or caching


def test_after_a_preemption_admission_holds_room_for_running_rows_to_grow():
    """Rows that outgrow the pool make the scheduler reserve part of every running row's
    remaining max_tokens before admitting another (instead of admitting it only to preempt and
    recompute it), and finished rows bring admission back to prompts alone."""
    s = scheduler(blocks=10)
    for i in range(3):
        s.add(seq(i, 4, max_tokens=12))  # each needs 4 blocks at the end: 12 in all, 2 now
    for _ in range(20):
        step = s.schedule()
        run(s, step)
        if step.preempted:
            break
    assert s.preemptions == 1 and s.growth > 0
    s.add(seq(9, 4, max_tokens=12))
    waited = 0
    for _ in range(40):
        step = s.schedule()
        if any(q.index == 9 for q in step.admitted):
            break
        waited += 1
        run(s, step)
    assert waited > 0, "the new row waited for room"
    held = s.growth
    for _ in range(100):
        if not s.has_work():
            break
        run(s, s.schedule())
    assert not s.has_work() and s.growth < held
    assert s.preemptions == 1, "no row admitted after the first preemption was preempted"


def test_admission_holds_room_for_the_peak_of_growth_over_time_not_the_sum_of_the_ends():
    """With growth, admission projects each row to `growth` of its remaining max_tokens: a row
    that ends soon frees its blocks for the rows still growing, so what must fit is the peak
    over the coming steps, not every row's end at once."""
    s = scheduler(blocks=10)
    s.add(seq(0, 4, max_tokens=20))  # after one step: 2 blocks held, 6 at its end 18 steps on
    run(s, s.schedule())
    s.growth = 1.0  # as after preemptions: rows are expected to use all their max_tokens
    s.add(seq(1, 16, max_tokens=4))  # 5 blocks now and at its end, 3 steps on; 3 left free
    # every end at once: row 0's 4 more blocks > 3; over time: at step 3 row 0 holds 3 (+1), and
    # row 1's 5 blocks are free again long before row 0 needs its last ones
    assert [q.index for q in s.schedule().admitted] == [1]


def test_a_row_whose_growth_would_overflow_the_pool_at_the_peak_waits():
    s = scheduler(blocks=12)
    s.add(seq(0, 4, max_tokens=20))
    run(s, s.schedule())  # row 0: 2 blocks held, 6 at its end 18 steps on
    s.add(seq(2, 8, max_tokens=20))  # 3 blocks now (7 left free), 7 at its end 19 steps on
    s.growth = 1.0  # at step 18 row 0 needs 4 more and row 2 4 more: 8 > 7
    assert not s.schedule().admitted
    s.growth = 0.5  # both end 10 steps on, 2 more blocks each
    assert [q.index for q in s.schedule().admitted] == [2]


def test_the_projected_peak_counts_rows_that_end_earlier_as_freeing_their_own_blocks():
    from engine.core.scheduler import Projection

    pool = BlockPool(100, 4)
    projection = Projection([], pool, growth=1.0)
    # (tokens now, tokens at the end, blocks held, blocks only it holds)
    assert projection.peak([(5, 5 + 8, 2, 2)]) == 2  # 13 tokens: 4 blocks, 2 more
    # row b ends at step 4 (frees its 5 own blocks); row a grows 40 tokens: 10 more blocks by step 40
    a, b = (1, 41, 0, 0), (20, 24, 5, 5)
    assert projection.peak([a, b]) == max(2 + 1, 11 - 5)  # step 4: a 2 blocks, b 6 (+1); step 40: a 11, b gone
    shared = (20, 24, 5, 0)  # the same row b, its blocks shared with another row: ending frees nothing
    assert projection.peak([a, shared]) == 11
