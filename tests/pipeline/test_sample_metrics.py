"""pass@k and maj@n over hand-made sample rows, against the estimator written out here."""
import math
import random

import pyarrow as pa
import pytest

from pipeline.run.reporting.metrics import compute_metrics
from pipeline.run.reporting.sample_metrics import SampleMetrics, majority, pass_at_k

Z = 1.959963984540054


def chen(n: int, c: int, k: int) -> float:
    """Chen et al. 2021's numerically stable form of 1 - C(n-c, k) / C(n, k) (their Figure 3)."""
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def test_pass_at_k_is_the_unbiased_estimator_including_none_and_all_correct():
    for n in range(1, 11):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert float(pass_at_k(n, c, k)) == pytest.approx(chen(n, c, k), abs=1e-12)
    assert pass_at_k(5, 0, 3) == 0 and pass_at_k(5, 5, 1) == 1 and pass_at_k(4, 1, 1) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(3, 1, 4)


def test_majority_breaks_ties_by_the_lowest_sample_index():
    assert majority(["b", "a", "a", "b"]) == "b"
    assert majority(["a", "b", "b", "a"]) == "a"
    assert majority([None, "c", None]) == "c" and majority([None, None]) is None
    assert majority(["x", "y", "y"]) == "y"


# id -> (reference, group, [(text, finish_reason)] in sample order)
SAMPLES = {
    "a": ("x", "g1", [("x", "stop")] * 4),                                           # c = n
    "b": ("x", "g1", [("p", "stop"), ("q", "stop"), ("p", "stop"), ("r", "stop")]),  # c = 0
    "c": ("x", "g2", [("x", "stop"), (" Y", "stop"), ("", "error"), ("y ", "stop")]),  # a failed sample
    "t": ("A", "g2", [("A", "length"), ("B", "stop"), ("B", "stop"), ("A", "stop")]),  # 2-2 tie: "A" wins
    "d": (None, "g2", [("x", "stop")] * 4),                                          # no reference: unscored
}


def sample_rows(order_seed: int = 0) -> list[dict]:
    rows = []
    for row_id, (ref, group, samples) in SAMPLES.items():
        for j, (text, reason) in enumerate(samples):
            score = None if ref is None or reason == "error" else float(text.strip().lower() == ref.lower())
            rows.append({"id": row_id, "sample_index": j, "generated_text": text, "finish_reason": reason,
                         "answer": ref, "topic": group, "score_exact_match": score})
    random.Random(order_seed).shuffle(rows)  # parts do not keep sample order
    return rows


def accumulator(ks=(1, 2, 4)) -> SampleMetrics:
    return SampleMetrics(["exact_match"], 4, list(ks), reference_column="answer", group_column="topic",
                         normalize={"lowercase": True})


def normal(values: list[float]) -> list[float]:
    m = sum(values) / len(values)
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))
    half = Z * sd / math.sqrt(len(values))
    return [round(max(0.0, m - half), 6), round(min(1.0, m + half), 6)]


def test_metrics_file_gains_pass_at_k_and_maj_at_n_per_metric_and_group():
    rows = sample_rows()
    result = compute_metrics([pa.Table.from_pylist(rows)], ["exact_match"], "topic", accumulator())
    em = result["metrics"]["exact_match"]
    assert result["rows"] == 20 and result["inputs"] == 5 and result["samples"] == 4
    assert em["count"] == 15 and em["sum"] == 7.0  # the sample rows' own score, as before
    correct = {"a": 4, "b": 0, "c": 1, "t": 2}  # c: " Y" and "y " are wrong, the failed sample too
    for k in (1, 2, 4):
        values = [chen(4, c, k) for c in correct.values()]
        entry = em[f"pass@{k}"]
        assert entry["mean"] == round(sum(values) / 4, 6) and entry["count"] == 4 and entry["unscored"] == 1
        assert entry["ci95"] == normal(values) and entry["ci_method"] == "normal"
    # votes after normalisation: a -> x (right), b -> p (wrong), c -> y twice (wrong), t -> tie A/B -> A (right)
    maj = em["maj@4"]
    assert (maj["mean"], maj["count"], maj["sum"], maj["unscored"], maj["ci_method"]) == (0.5, 4, 2.0, 1, "wilson")
    g1, g2 = (result["groups"][g] for g in ("g1", "g2"))
    assert (g1["rows"], g1["inputs"], g2["rows"], g2["inputs"]) == (8, 2, 12, 3)
    assert g1["metrics"]["exact_match"]["pass@4"]["mean"] == 0.5 and g1["metrics"]["exact_match"]["maj@4"]["sum"] == 1
    assert g2["metrics"]["exact_match"]["pass@1"]["mean"] == round((0.25 + 0.5) / 2, 6)
    assert g2["metrics"]["exact_match"]["maj@4"]["count"] == 2


def test_part_order_and_merge_do_not_change_pass_at_k():
    rows = sample_rows(1)
    ids = sorted(SAMPLES)
    parts = [pa.Table.from_pylist([r for r in rows if r["id"] in ids[:2]]),
             pa.Table.from_pylist([r for r in rows if r["id"] in ids[2:]])]
    one = compute_metrics(parts, ["exact_match"], "topic", accumulator())
    other = compute_metrics(parts[::-1], ["exact_match"], "topic", accumulator())
    assert one == other == compute_metrics([pa.Table.from_pylist(sample_rows(2))], ["exact_match"], "topic",
                                           accumulator())
    first, second = accumulator(), accumulator()
    first.add(parts[0])
    second.add(parts[1])
    first.merge(second)
    whole = accumulator()
    whole.add(pa.Table.from_pylist(rows))
    assert first.result() == whole.result()


def test_maj_at_n_votes_on_the_extracted_answer_for_regex_match():
    texts = ["the answer is 5", "answer: 5!", "it is 7", "no idea"]
    rows = [{"id": "q", "sample_index": j, "generated_text": t, "finish_reason": "stop", "answer": "5",
             "score_regex_match": float(t != "it is 7" and t != "no idea")} for j, t in enumerate(texts)]
    acc = SampleMetrics(["regex_match"], 4, None, reference_column="answer", answer_regex=r"(\d+)")
    result = compute_metrics([pa.Table.from_pylist(rows)], ["regex_match"], None, acc)
    entry = result["metrics"]["regex_match"]
    assert entry["maj@4"]["sum"] == 1.0 and set(entry) >= {"pass@1", "pass@4", "maj@4"}  # default k = [1, n]
    assert entry["pass@1"]["mean"] == 0.5 and entry["pass@4"]["mean"] == 1.0


def test_structured_outputs_cut_by_max_tokens_do_not_vote():
    """Two samples cut before their JSON closed (finish "length", error INCOMPLETE) agree with
    each other, but they failed as everywhere else: the one complete sample wins maj@3."""
    from pipeline.spec import INCOMPLETE

    rows = [{"id": "q", "sample_index": j, "generated_text": t, "finish_reason": f, "error": e, "answer": '{"a": 2}',
             "score_exact_match": s}
            for j, (t, f, e, s) in enumerate([('{"a": 1', "length", INCOMPLETE, None),
                                               ('{"a": 1', "length", INCOMPLETE, None),
                                               ('{"a": 2}', "stop", None, 1.0)])]
    acc = SampleMetrics(["exact_match"], 3, None, reference_column="answer")
    result = compute_metrics([pa.Table.from_pylist(rows)], ["exact_match"], None, acc)
    assert result["metrics"]["exact_match"]["maj@3"]["sum"] == 1.0


def test_a_row_with_fewer_samples_than_k_is_an_error():
    rows = [{"id": "q", "sample_index": 0, "generated_text": "x", "finish_reason": "stop", "answer": "x",
             "score_exact_match": 1.0}]
    with pytest.raises(ValueError, match="fewer than k=2"):
        compute_metrics([pa.Table.from_pylist(rows)], ["exact_match"], None,
                        SampleMetrics(["exact_match"], 2, None, reference_column="answer"))
