"""Batch formation: pure logic, no model."""
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, Status


def seq(i, prompt_len, max_tokens):
    return Sequence(index=i, prompt_token_ids=[5] * prompt_len, params=SamplingParams(max_tokens=max_tokens), seed=0)


def drain(s: Scheduler):
    batches = []
    while s.has_waiting():
        batches.append(s.next_batch())
    return batches


def test_batches_respect_token_budget_and_row_limit():
    s = Scheduler(max_batch_tokens=1000, max_num_seqs=4, max_model_len=4096)
    seqs = [seq(i, 10 + (i * 37) % 200, 8 + (i * 13) % 50) for i in range(40)]
    for q in seqs:
        assert s.add(q)
    batches = drain(s)
    assert sorted(q.index for b in batches for q in b) == list(range(40))
    for b in batches:
        assert len(b) <= 4
        reserved = len(b) * (max(q.num_prompt_tokens for q in b) + max(q.params.max_tokens for q in b))
        assert reserved <= 1000
        assert all(q.status is Status.RUNNING for q in b)


def test_longest_first_and_similar_lengths_together():
    s = Scheduler(max_batch_tokens=10_000, max_num_seqs=2, max_model_len=4096)
    for i, n in enumerate([5, 300, 7, 290, 100, 110]):
        s.add(seq(i, n, 10))
    assert [[q.num_prompt_tokens for q in b] for b in drain(s)] == [[300, 290], [110, 100], [7, 5]]


def test_requests_that_can_never_fit_fail_with_the_limit_named():
    s = Scheduler(max_batch_tokens=100, max_num_seqs=4, max_model_len=64)
    too_long = seq(0, 60, 10)
    too_big = seq(1, 30, 10)
    empty = seq(2, 0, 10)
    s2 = Scheduler(max_batch_tokens=30, max_num_seqs=4, max_model_len=64)
    assert not s.add(too_long) and too_long.finish_reason == "error"
    assert "max_model_len (64)" in too_long.error and "70" in too_long.error
    assert not s2.add(too_big) and "max_batch_tokens (30)" in too_big.error
    assert not s.add(empty) and "empty prompt" in empty.error
    assert s.add(seq(3, 10, 10))
    assert [q.index for q in s.next_batch()] == [3]


def test_single_request_at_exact_budget_runs():
    s = Scheduler(max_batch_tokens=50, max_num_seqs=4, max_model_len=64)
    assert s.add(seq(0, 40, 10))
    assert len(s.next_batch()) == 1


def test_continuous_admission_respects_rows_budget_and_prefill_cap():
    s = Scheduler(max_batch_tokens=1000, max_num_seqs=4, max_model_len=4096, max_prefill_tokens=120)
    for i, (p, m) in enumerate([(50, 150), (40, 100), (30, 60), (20, 20), (10, 10), (10, 5)]):
        s.add(seq(i, p, m))
    # widest first: 200 columns; the prefill cap (rows x longest prompt <= 120) allows 2 rows
    first = s.admit(running=0, widest=0)
    assert [q.index for q in first] == [0, 1]
    assert [q.index for q in s.admit(running=2, widest=200)] == [2, 3]  # 4 x 200 = 800 <= 1000
    assert s.admit(running=4, widest=200) == []  # no free row
    assert [q.index for q in s.admit(running=3, widest=200)] == [4]  # one row freed
    assert s.admit(running=4, widest=140) == []
    assert [q.index for q in s.admit(running=3, widest=140)] == [5]
    assert not s.has_waiting()


def test_continuous_admission_waits_for_kv_budget():
    s = Scheduler(max_batch_tokens=300, max_num_seqs=8, max_model_len=4096)
    for i in range(3):
        s.add(seq(i, 50, 50))
    assert len(s.admit(running=0, widest=0)) == 3  # 3 x 100 = 300
    s.add(seq(3, 10, 10))
    assert s.admit(running=3, widest=100) == []  # 4 x 100 > 300
    assert [q.index for q in s.admit(running=2, widest=100)] == [3]


def test_continuous_refill_waits_for_a_share_of_the_batch_when_asked():
    s = Scheduler(max_batch_tokens=10_000, max_num_seqs=16, max_model_len=4096, min_join_fraction=0.25)
    for i in range(21):
        s.add(seq(i, 10, 10))
    assert len(s.admit(running=0, widest=0)) == 16  # an empty batch fills at once
    assert s.admit(running=15, widest=20) == []  # 1 of 16 rows free: below a quarter
    assert s.admit(running=13, widest=20) == []  # 3 of 16
    assert len(s.admit(running=12, widest=20)) == 4  # 4 of 16: a quarter joins in one prefill
    assert len(s.admit(running=15, widest=20)) == 1  # the last waiting request never waits
    assert not s.has_waiting()


def test_prefill_groups_split_under_the_prefill_cap():
    s = Scheduler(max_batch_tokens=10_000, max_num_seqs=64, max_model_len=4096, max_prefill_tokens=100)
    pending = [seq(i, n, 4) for i, n in enumerate([40, 30, 30, 120, 5])]
    groups = []
    while pending:
        group, pending = s.prefill_group(pending)
        groups.append([q.num_prompt_tokens for q in group])
    assert groups == [[40, 30], [30], [120], [5]]  # a prompt over the cap still runs, alone
