"""sampling.n in a job's rows, on the tiny model and without Ray: one output row per sample, and
with n = 1 the rows of a spec that never heard of n."""
import pyarrow as pa
import pytest

from engine import EngineConfig, LLMEngine
from pipeline.spec import BASE_COLUMNS, Row, validate
from pipeline.tasks import TaskRunner, output_table


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model="builtin:tiny"))


def spec(**sections):
    sampling = {"max_tokens": 3, "temperature": 1.0, "ignore_eos": True, **sections.pop("sampling", {})}
    return validate({"input": {"path": "-"}, "output": {"path": "-"}, "sampling": sampling, **sections})


def table(engine, job, rows, ids):
    runner = TaskRunner(job, engine)
    return output_table(job, Row.batch(rows, ids), runner.run(Row.batch(rows, ids)))


ROWS = [{"prompt": "one"}, {"prompt": None}, {"prompt": "three"}]
IDS = ["a", "b", "c"]


def test_n_1_writes_the_rows_and_fingerprint_of_a_spec_without_n(engine):
    plain, one = spec(), spec(sampling={"n": 1})
    assert one.fingerprint() == plain.fingerprint()
    before, after = table(engine, plain, ROWS, IDS), table(engine, one, ROWS, IDS)
    assert after.column_names == before.column_names == ["id", "prompt", *BASE_COLUMNS]
    assert after.equals(before) and after.num_rows == 3


def test_n_3_gives_three_rows_per_id_with_sample_index_and_sample_0_is_the_n_1_row(engine):
    sampled = table(engine, spec(sampling={"n": 3}), ROWS, IDS)
    assert sampled.column_names == ["id", "sample_index", "prompt", *BASE_COLUMNS]
    rows = sampled.to_pylist()
    assert [(r["id"], r["sample_index"]) for r in rows] == [(i, j) for i in IDS for j in range(3)]
    single = {r["id"]: r for r in table(engine, spec(), ROWS, IDS).to_pylist()}
    for r in rows:
        if r["sample_index"] == 0:
            assert {k: v for k, v in r.items() if k != "sample_index"} == single[r["id"]]
    texts = [r["generated_text"] for r in rows if r["id"] == "a"]
    assert len(set(texts)) == 3, "samples at temperature 1 differ"
    failed = [r for r in rows if r["id"] == "b"]  # a row that fails first still has its n rows
    assert all(r["finish_reason"] == "error" and r["error"] == "prompt is null" for r in failed)
    assert all(r["num_generated_tokens"] == 3 for r in rows if r["id"] != "b")
    # the same samples whatever else is in the batch, and in whatever order
    again = table(engine, spec(sampling={"n": 3}), [ROWS[2], {"prompt": "other"}], ["c", "x"]).to_pylist()
    assert [r["generated_text"] for r in again if r["id"] == "c"] == [r["generated_text"] for r in rows
                                                                      if r["id"] == "c"]


def test_each_sample_row_keeps_its_scores_and_parsed_label(engine):
    job = spec(sampling={"n": 4}, task="eval", label={"label_regex": "(.)"},
               eval={"reference_column": "answer", "metrics": ["exact_match", "accuracy"]})
    rows = table(engine, job, [{"prompt": "q", "answer": "zz-never"}], ["q"]).to_pylist()
    assert [r["sample_index"] for r in rows] == [0, 1, 2, 3]
    assert all(r["label"] == r["generated_text"][0] for r in rows)
    assert all(r["score_exact_match"] == 0.0 and r["score_accuracy"] == 0.0 for r in rows)


def test_body_n_above_1_needs_a_place_for_its_samples(engine):
    request = {"custom_id": "r", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "n": 2}}
    job = spec(input={"path": "-", "format": "openai_batch"})
    rows = table(engine, job, [request], ["r"]).to_pylist()
    assert len(rows) == 1 and rows[0]["finish_reason"] == "error"
    assert rows[0]["error"].startswith("body.n > 1 needs output.format openai_batch")


def test_an_openai_request_asking_for_one_sample_writes_one_row_in_a_job_of_two(engine):
    """sampling.n is the default; a request's body.n is what it gets: one sample is one row, not
    two copies of it numbered 0 and 1 (which doubled its rows and tokens)."""
    def request(custom_id, **body):
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", **body}}

    job = spec(input={"path": "-", "format": "openai_batch"}, output={"path": "-", "format": "jsonl"},
               sampling={"n": 2})
    rows = table(engine, job, [request("one", n=1), request("three", n=3), request("default")],
                 ["one", "three", "default"]).to_pylist()
    assert [(r["id"], r["sample_index"]) for r in rows] == [("one", 0), ("three", 0), ("three", 1), ("three", 2),
                                                             ("default", 0), ("default", 1)]
    assert all(r["finish_reason"] == "length" for r in rows)


def test_cache_hits_are_counted_as_the_rows_prompt_tokens_are():
    """Per sample row: every sample's hits; per OpenAI Batch line: the prompt once (its samples'
    least), and none for an error line, which reports no usage."""
    from pipeline.tasks import RowResult

    def sample(cached, finish="length", index=0):
        return RowResult("t", 40, 2, finish, None if finish != "error" else "boom", sample_index=index,
                         num_cached_tokens=cached)

    ok = RowResult(samples=[sample(0), sample(32, index=1), sample(32, index=2)])
    assert ok.cached_prompt_tokens(per_sample=True) == 64 and ok.cached_prompt_tokens(per_sample=False) == 0
    shared = RowResult(samples=[sample(16), sample(32, index=1)])
    assert shared.cached_prompt_tokens(per_sample=False) == 16
    failed = RowResult(samples=[sample(16), sample(32, "error", 1)])
    assert failed.cached_prompt_tokens(per_sample=False) == 0 and failed.cached_prompt_tokens(per_sample=True) == 48
    assert sample(24).cached_prompt_tokens(per_sample=False) == 24


def test_openai_lines_with_n_samples_count_each_prompt_once_in_the_hit_rate(engine):
    """A request's n samples share its prompt's blocks, but its line's usage counts the prompt
    once, so the cache hits counted for it are its prompt's (not n - 1 more copies): the first
    line's prompt is computed once (no hit), the second, sharing its first 64 bytes, finds
    those 4 blocks cached. What the worker records for the shard, without Ray."""
    import json

    from pipeline.io.formats import openai_batch

    shared = "Answer in one word. " * 3 + "Q1"  # 62 bytes: with BOS, 4 full blocks of 16
    bodies = [{"prompt": shared + ": sky colour?", "n": 4, "max_tokens": 2, "temperature": 1.0, "seed": 1},
              {"prompt": shared + ": grass colour?", "n": 4, "max_tokens": 2, "temperature": 1.0, "seed": 2}]
    rows = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": b} for i, b in enumerate(bodies)]
    job = spec(input={"path": "-", "format": "openai_batch"}, output={"path": "-", "format": "openai_batch"})
    engine.pool.reset_cache()  # nothing cached from other tests
    runner = TaskRunner(job, engine)
    results = runner.run(Row.batch(rows, ["r0", "r1"]))
    lines = [json.loads(x) for x in runner.openai_lines(Row.batch(rows, ["r0", "r1"]), results, 0)]
    prompt = openai_batch.count(pa.table({"line": [json.dumps(x) for x in lines]})).prompt_tokens
    cached = sum(r.cached_prompt_tokens(per_sample=False) for r in results)
    assert prompt == sum(x["response"]["body"]["usage"]["prompt_tokens"] for x in lines)
    assert cached == 4 * 16 and [len(x["response"]["body"]["choices"]) for x in lines] == [4, 4]
    assert sum(r.cached_prompt_tokens(per_sample=True) for r in results) > prompt  # siblings' hits, per sample row
