import json
import math
import re

import pyarrow as pa
import pytest

from pipeline.run.reporting.metrics import MetricsAccumulator, compute_metrics, wilson_interval
from pipeline.spec import METRICS, check_metrics
from pipeline.tasks import Normalizer, extract_answer, normalize, score_columns, score_row

Z = 1.959963984540054


def wilson(s, n):
    """The Wilson interval written out independently of the module, rounded like metrics.json."""
    p = s / n
    center = (p + Z * Z / (2 * n)) / (1 + Z * Z / n)
    half = Z / (1 + Z * Z / n) * math.sqrt(p * (1 - p) / n + Z * Z / (4 * n * n))
    return [round(max(0.0, center - half), 6), round(min(1.0, center + half), 6)]


def agg(s, n, unscored):
    return {"mean": round(s / n, 6), "count": n, "sum": float(s), "unscored": unscored,
            "ci95": wilson(s, n), "ci_method": "wilson"}


# -- normalisation --------------------------------------------------------------------------------


def test_normalize_options():
    assert normalize("  The  Answer:\n Paris. ") == "The Answer: Paris."
    assert normalize("  The  Answer:\n Paris. ", strip=False) == "  The  Answer:\n Paris. "
    assert normalize(" The Answer: Paris. ", lowercase=True) == "the answer: paris."
    assert normalize("«Hello», world — it's “fine”!", remove_punctuation=True) == "Hello world its fine"
    assert normalize("a - b", remove_punctuation=True) == "a b"  # whitespace collapsed after removal
    assert normalize("$5 + 3", remove_punctuation=True) == "$5 + 3"  # symbols are not punctuation
    assert normalize("ÉTÉ!", lowercase=True, remove_punctuation=True) == "été"
    assert Normalizer(lowercase=True)(" X ") == "x"


def test_normalizer_from_options():
    assert Normalizer.from_options(None) == Normalizer()
    assert Normalizer.from_options({"lowercase": True}) == Normalizer(lowercase=True)
    with pytest.raises(ValueError, match="unknown normalisation options: casefold"):
        Normalizer.from_options({"casefold": True})
    with pytest.raises(ValueError, match="must be true or false"):
        Normalizer.from_options({"strip": "yes"})


# -- per-row scores -------------------------------------------------------------------------------


def test_exact_match_and_contains():
    lower = {"lowercase": True, "remove_punctuation": True}
    assert score_row("Paris", "Paris", "exact_match", normalize_opts=None) == 1.0
    assert score_row("paris", "Paris", "exact_match", normalize_opts=None) == 0.0
    assert score_row("Paris.", "paris", "exact_match", normalize_opts=lower) == 1.0
    assert score_row(" Paris\n", "Paris", "exact_match", normalize_opts={"strip": True}) == 1.0
    assert score_row(" Paris\n", "Paris", "exact_match", normalize_opts={"strip": False}) == 0.0
    assert score_row("It is Paris.", "paris", "contains", normalize_opts=lower) == 1.0
    assert score_row("It is Rome.", "paris", "contains", normalize_opts=lower) == 0.0
    assert score_row("Paris", "It is Paris", "contains", normalize_opts=None) == 0.0


def test_list_references_and_non_string_values():
    assert score_row("colour", ["color", "colour"], "exact_match", normalize_opts=None) == 1.0
    assert score_row("hue", ("color", "colour"), "exact_match", normalize_opts=None) == 0.0
    assert score_row("the colour red", ["color", None, "colour"], "contains", normalize_opts=None) == 1.0
    assert score_row("42", 42, "exact_match", normalize_opts=None) == 1.0
    assert score_row("3", 3.0, "exact_match", normalize_opts=None) == 1.0  # integral float -> "3"
    assert score_row("2.5", 2.5, "exact_match", normalize_opts=None) == 1.0
    assert score_row("true", True, "exact_match", normalize_opts={"lowercase": True}) == 1.0
    assert score_row("True", True, "exact_match", normalize_opts=None) == 1.0


def test_unscored_rows():
    for metric in METRICS:
        kw = {"normalize_opts": None, "answer_regex": r"(\d+)"}
        assert score_row("x", None, metric, **kw) is None       # no reference
        assert score_row("x", [], metric, **kw) is None         # empty list of answers
        assert score_row("x", [None], metric, **kw) is None
        assert score_row(None, "x", metric, **kw) is None       # error row


def test_regex_match_first_match_and_groups():
    rx = r"answer is (\-?\d+)"
    assert extract_answer("the answer is 12, no, the answer is 13", rx) == "12"  # first match
    assert extract_answer("no number here", rx) is None
    assert extract_answer("values: 7 and 8", r"\d+") == "7"  # no group: the whole match
    assert extract_answer("x", r"(a)?x") is None  # group 1 did not take part
    assert score_row("so the answer is 12.", "12", "regex_match", normalize_opts=None, answer_regex=rx) == 1.0
    assert score_row("the answer is 12, no, 13", "13", "regex_match", normalize_opts=None, answer_regex=rx) == 0.0
    assert score_row("I do not know", "12", "regex_match", normalize_opts=None, answer_regex=rx) == 0.0
    assert score_row("Answer: B)", ["b"], "regex_match", answer_regex=re.compile(r"Answer:\s*(\w)"),
                     normalize_opts={"lowercase": True}) == 1.0
    with pytest.raises(ValueError, match="needs an answer_regex"):
        score_row("x", "x", "regex_match", normalize_opts=None)


def test_accuracy_compares_labels():
    assert score_row("positive", "positive", "accuracy", normalize_opts=None) == 1.0
    assert score_row("negative", "positive", "accuracy", normalize_opts=None) == 0.0
    assert score_row("Positive", "positive", "accuracy", normalize_opts={"lowercase": True}) == 1.0
    assert score_row("positive", ["positive", "pos"], "accuracy", normalize_opts=None) == 1.0


def test_check_metrics_errors():
    check_metrics(["exact_match", "regex_match"], r"(\d+)")
    with pytest.raises(ValueError, match="unknown metric"):
        check_metrics(["f1"])
    with pytest.raises(ValueError, match="non-empty list"):
        check_metrics([])
    with pytest.raises(ValueError, match="twice"):
        check_metrics(["contains", "contains"])
    with pytest.raises(ValueError, match="needs an answer_regex"):
        check_metrics(["regex_match"])
    with pytest.raises(ValueError, match="invalid answer_regex"):
        check_metrics(["regex_match"], "(unclosed")
    with pytest.raises(ValueError, match="unknown metric 'f1'"):
        score_row("a", "a", "f1", normalize_opts=None)


def test_score_columns():
    cols = score_columns(["Paris", "It's Rome", None], ["paris", "rome", "x"], ["exact_match", "contains"],
                         normalize_opts={"lowercase": True})
    assert cols == {"score_exact_match": [1.0, 0.0, None], "score_contains": [1.0, 1.0, None]}
    with pytest.raises(ValueError, match="2 predictions but 1 references"):
        score_columns(["a", "b"], ["a"], ["exact_match"])


# -- aggregation ----------------------------------------------------------------------------------


def test_wilson_interval_closed_forms():
    assert wilson_interval(0, 0) is None
    lo, hi = wilson_interval(0, 5)  # s = 0: [0, z^2 / (n + z^2)]
    assert lo == 0.0 and hi == pytest.approx(Z * Z / (5 + Z * Z))
    lo, hi = wilson_interval(1, 1)  # s = n = 1: [1 / (1 + z^2), 1]
    assert lo == pytest.approx(1 / (1 + Z * Z)) and hi == pytest.approx(1.0)
    assert wilson(1, 1) == [0.206549, 1.0]
    # the bounds are the roots of (s/n - p)^2 = z^2 p (1 - p) / n, a quadratic in p
    n, ph = 6, 4 / 6
    a, b, c = 1 + Z * Z / n, -(2 * ph + Z * Z / n), ph * ph
    roots = sorted((-b + sign * math.sqrt(b * b - 4 * a * c)) / (2 * a) for sign in (-1, 1))
    assert wilson_interval(4, 6) == pytest.approx(roots)
    assert wilson(4, 6) == [0.299993, 0.903229]


EVAL_ROWS = [
    # prediction,               reference,                          subject   exact contains
    ("Paris.",                  "paris",                            "geo"),   # 1     1
    ("The answer is Paris",     "Paris",                            "geo"),   # 0     1
    ("42",                      42,                                 "geo"),   # 1     1
    (None,                      "Rome",                             "geo"),   # error row: unscored
    ("London",                  None,                               "bio"),   # no reference: unscored
    ("mitochondria",            ["Mitochondrion", "mitochondria"],  "bio"),   # 1     1
    ("nucleus",                 "ribosome",                         "bio"),   # 0     0
    ("  Ribosome ",             "ribosome",                         None),    # 1     1
]


def scored_parts():
    """The eval rows scored as a worker would, committed as two parts."""
    preds, refs, subjects = zip(*EVAL_ROWS)
    cols = score_columns(preds, refs, ["exact_match", "contains"],
                         normalize_opts={"lowercase": True, "remove_punctuation": True})
    table = pa.table({"id": list(range(len(EVAL_ROWS))), "subject": list(subjects), **cols})
    return [table.slice(0, 5), table.slice(5)]


def test_hand_computed_eval_gives_the_expected_metrics_file():
    result = compute_metrics(scored_parts(), ["exact_match", "contains"], group_column="subject")
    assert result == {
        "rows": 8,
        "metrics": {"exact_match": agg(4, 6, 2), "contains": agg(5, 6, 2)},
        "group_column": "subject",
        "groups": {
            "bio": {"rows": 3, "metrics": {"exact_match": agg(1, 2, 1), "contains": agg(1, 2, 1)}},
            "geo": {"rows": 4, "metrics": {"exact_match": agg(2, 3, 1), "contains": agg(3, 3, 1)}},
            "null": {"rows": 1, "metrics": {"exact_match": agg(1, 1, 0), "contains": agg(1, 1, 0)}},
        },
    }
    # literal numbers for a few of them, so the test does not only trust its own formula
    assert result["metrics"]["exact_match"]["mean"] == 0.666667
    assert result["metrics"]["exact_match"]["ci95"] == [0.299993, 0.903229]
    assert result["groups"]["null"]["metrics"]["contains"]["ci95"] == [0.206549, 1.0]
    assert json.loads(json.dumps(result)) == result  # plain JSON types only


def test_order_of_parts_and_merge_do_not_change_the_result():
    a, b = scored_parts()
    forward = compute_metrics([a, b], ["exact_match"], "subject")
    assert compute_metrics([b, a], ["exact_match"], "subject") == forward
    left, right = MetricsAccumulator(["exact_match"], "subject"), MetricsAccumulator(["exact_match"], "subject")
    left.add(a)
    right.add(b)
    left.merge(right)
    assert left.result() == forward


def test_ungrouped_and_empty_results():
    ungrouped = compute_metrics(scored_parts(), ["contains"])
    assert ungrouped == {"rows": 8, "metrics": {"contains": agg(5, 6, 2)}, "group_column": None, "groups": {}}
    empty = compute_metrics([], ["exact_match"], "subject")
    assert empty == {"rows": 0, "metrics": {"exact_match": {
        "mean": None, "count": 0, "sum": 0.0, "unscored": 0, "ci95": None, "ci_method": "wilson"}},
        "group_column": "subject", "groups": {}}


def test_json_typed_parts_all_null_and_int_columns():
    """Parts read back from JSONL may type an all-null column as null and 1/0 as int."""
    t = pa.table({"g": pa.array([None, None]), "score_accuracy": pa.array([None, None])})
    u = pa.table({"g": pa.array([1, 1]), "score_accuracy": pa.array([1, 0])})
    result = compute_metrics([t, u], ["accuracy"], "g")
    assert result["metrics"]["accuracy"] == agg(1, 2, 2)
    assert result["groups"] == {"1": {"rows": 2, "metrics": {"accuracy": agg(1, 2, 0)}},
                                "null": {"rows": 2, "metrics": {"accuracy": {
                                    "mean": None, "count": 0, "sum": 0.0, "unscored": 2, "ci95": None,
                                    "ci_method": "wilson"}}}}


def test_accumulator_errors():
    acc = MetricsAccumulator(["exact_match"], "subject")
    with pytest.raises(ValueError, match="no column 'score_exact_match'"):
        acc.add(pa.table({"subject": ["a"]}))
    with pytest.raises(ValueError, match="no group column 'subject'"):
        acc.add(pa.table({"score_exact_match": [1.0]}))
    with pytest.raises(ValueError, match="1 value\\(s\\) other than 0, 1 or null"):
        acc.add(pa.table({"subject": ["a", "a"], "score_exact_match": [0.5, None]}))
    with pytest.raises(ValueError, match="must hold numbers"):
        acc.add(pa.table({"subject": ["a"], "score_exact_match": ["yes"]}))
    with pytest.raises(ValueError, match="unknown metric"):
        MetricsAccumulator(["bleu"])
    with pytest.raises(ValueError, match="different metrics"):
        acc.merge(MetricsAccumulator(["contains"], "subject"))
