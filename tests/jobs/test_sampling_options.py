"""The token options in a job's sampling section (logit_bias, allowed_token_ids, bad_words,
skip_special_tokens): the rows the engine writes under them, and their fingerprint."""
from __future__ import annotations

import json

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from pipeline.errors import SpecError
from pipeline.spec import Row, output_columns, validate
from pipeline.tasks import TaskRunner

BASE = {"input": {"path": "in.jsonl"}, "output": {"path": "out/"}}


@pytest.fixture(scope="module")
def tiny():
    return LLMEngine(EngineConfig(model="builtin:tiny"))


def test_a_jobs_sampling_section_carries_the_token_options(tiny):
    hf = tiny.tokenizer.hf
    a, b = hf.convert_tokens_to_ids(["a", "b"])
    sampling = {"max_tokens": 8, "seed": 1, "ignore_eos": True, "allowed_token_ids": [a, b], "bad_words": ["aa"]}
    runner = TaskRunner(validate({**BASE, "sampling": sampling}), tiny)
    results = runner.run(Row.batch([{"prompt": f"row {i}"} for i in range(4)], [str(i) for i in range(4)]))
    for r in results:
        assert r.error is None and set(r.generated_text) <= {"a", "b"} and "aa" not in r.generated_text and len(r.generated_text) == 8
    forced = TaskRunner(validate({**BASE, "sampling": {"max_tokens": 3, "temperature": 0, "ignore_eos": True,
                                                        "logit_bias": {str(b): 100}}}), tiny)
    assert forced.run(Row.batch([{"prompt": "x"}], ["0"]))[0].generated_text == "bbb"


def test_the_options_count_in_the_fingerprint_only_when_set():
    plain = validate(BASE).fingerprint()
    assert validate({**BASE, "sampling": {"bad_words": [], "skip_special_tokens": True}}).fingerprint() == plain
    assert validate({**BASE, "sampling": {"bad_words": ["x"]}}).fingerprint() != plain
    assert validate({**BASE, "sampling": {"logit_bias": {"1": 2}}}).fingerprint() != plain
    with pytest.raises(SpecError, match="sampling.logprobs .25. is above engine.max_logprobs .20."):
        validate({**BASE, "sampling": {"logprobs": 25}})
    with pytest.raises(SpecError, match="logit_bias"):
        validate({**BASE, "sampling": {"logit_bias": {"1": 500}}})


def test_a_rows_sampling_column_overrides_the_section_for_that_row(tiny):
    spec = validate({"input": {"path": "in.jsonl", "sampling_column": "params"}, "output": {"path": "out/"},
                     "sampling": {"max_tokens": 6, "temperature": 0, "ignore_eos": True}})
    rows = [{"prompt": "a", "params": None}, {"prompt": "a", "params": {"max_tokens": 3}},
            {"prompt": "a", "params": {"max_tokens": 4, "temperature": None, "stop": ["zz"]}},
            {"prompt": "a", "params": {"temperature": -1}}, {"prompt": "a", "params": {"min_tokens": 9}},
            {"prompt": "a", "params": {"top_q": 1}}, {"prompt": "a", "params": "hot"},
            {"prompt": "a", "params": {"prompt_logprobs": 2}}]
    results = TaskRunner(spec, tiny).run(Row.batch(rows, [str(i) for i in range(len(rows))]))
    assert [r.num_generated_tokens for r in results[:3]] == [6, 3, 4]
    assert results[1].generated_text == results[0].generated_text[:len(results[1].generated_text)]  # greedy kept
    assert [r.error for r in results[3:]] == [
        "sampling_params: temperature must be >= 0.0, got -1.0", "sampling_params: min_tokens (9) must be <= max_tokens (6)",
        "sampling_params.top_q: unknown key", "sampling_params must be a mapping of sampling fields, got str",
        "sampling_params.prompt_logprobs: the job's sampling sets no prompt_logprobs, so its output has no "
        "prompt_logprobs column; set sampling.prompt_logprobs for the job"]
    assert all(r.finish_reason == "error" for r in results[3:])
    # where the job has the column, a row may ask for more of each prompt token's alternatives
    spec = validate({"input": {"path": "in.jsonl", "sampling_column": "params"}, "output": {"path": "out/"},
                     "sampling": {"max_tokens": 2, "temperature": 0, "prompt_logprobs": 0}})
    results = TaskRunner(spec, tiny).run(Row.batch([{"prompt": "ab", "params": None}, {"prompt": "ab", "params": {"prompt_logprobs": 2}}], ["0", "1"]))
    assert [r.error for r in results] == [None, None] and results[0].prompt_logprobs is not None
    assert results[1].prompt_logprobs[1:] and all(len(p) >= 2 for p in results[1].prompt_logprobs[1:])
    assert validate({**BASE, "input": {"path": "in.jsonl", "sampling_column": None}}).fingerprint() == validate(BASE).fingerprint()


@pytest.mark.usefixtures("ray_local")
def test_a_processor_rows_sampling_params_from_preprocess():
    import ray

    from pipeline import build_processor

    processor = build_processor({"model": "builtin:tiny", "sampling": {"max_tokens": 6, "temperature": 0,
                                                                       "ignore_eos": True},
                                 "workers": {"rows_per_batch": 4}},
                                preprocess=lambda row: {"prompt": "q", "n": row["n"],
                                                        "sampling_params": {"max_tokens": row["n"]} if row["n"]
                                                        else {"temperature": -2}})
    rows = {r["n"]: r for r in processor(ray.data.from_items([{"n": n} for n in range(5)])).take_all()}
    assert [rows[n]["num_generated_tokens"] for n in range(1, 5)] == [1, 2, 3, 4]
    assert rows[0]["finish_reason"] == "error" and rows[0]["error"].startswith("sampling_params: temperature")


def test_prompt_logprobs_column_and_openai_lines(tiny, tmp_path):
    from pipeline.tasks.table import output_table

    spec = validate({**BASE, "sampling": {"max_tokens": 2, "temperature": 0, "n": 2, "prompt_logprobs": 1}})
    assert validate({**BASE, "sampling": {"prompt_logprobs": None}}).fingerprint() == validate(BASE).fingerprint()
    assert spec.fingerprint() != validate({**BASE, "sampling": {"max_tokens": 2, "temperature": 0, "n": 2}}).fingerprint()
    rows = [{"prompt": "abc"}, {"prompt": "hello there"}]
    results = TaskRunner(spec, tiny).run(Row.batch(rows, ["0", "1"]))
    table = output_table(spec, Row.batch(rows, ["0", "1"]), results).to_pylist()
    want = tiny.generate(["abc", "hello there"], SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert len(table) == 4  # two samples per row, each with its row's prompt logprobs
    for record in table:
        w = want[int(record["id"])].prompt_logprobs
        assert record["prompt_logprobs"][0] is None and len(record["prompt_logprobs"]) == len(w)
        assert record["prompt_logprobs"][1:] == pytest.approx([next(iter(e.values())) for e in w[1:]])
    assert "prompt_logprobs" not in output_columns(validate({**BASE, "task": "label", "label": {"choices": ["a", "b"]},
                                                             "sampling": {"prompt_logprobs": 0}}))
    with pytest.raises(SpecError, match="sampling.prompt_logprobs .21. is above engine.max_logprobs"):
        validate({**BASE, "sampling": {"prompt_logprobs": 21}})

    oa = validate({"input": {"path": "in.jsonl", "format": "openai_batch"}, "output": {"path": "out/", "format": "openai_batch"}})
    lines = [{"custom_id": "a", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "abc", "max_tokens": 1, "prompt_logprobs": 2}},
             {"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"prompt": "abc", "max_tokens": 1}},
             {"custom_id": "c", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "abc", "max_tokens": 1, "prompt_logprobs": 30}}]
    runner = TaskRunner(oa, tiny)
    out = [json.loads(x) for x in runner.openai_lines(Row.batch(lines, ["a", "b", "c"]), runner.run(Row.batch(lines, ["a", "b", "c"])), 1700000000)]
    body = out[0]["response"]["body"]
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    second = body["prompt_logprobs"][1]
    assert {v["rank"] for v in second.values()} >= {1, 2} and all("decoded_token" in v for v in second.values())
    assert "prompt_logprobs" not in out[1]["response"]["body"]
    assert out[2]["error"]["message"] == "prompt_logprobs 30 is above max_logprobs (20; EngineConfig.max_logprobs)"
    # the engine's max_logprobs bounds a line's logprobs, as vLLM's server does: not OpenAI's 5 and 20
    wide = validate({"input": {"path": "in.jsonl", "format": "openai_batch"}, "engine": {"max_logprobs": 32},
                     "output": {"path": "out/", "format": "openai_batch"}})
    lines = [lines[2], {"custom_id": "d", "method": "POST", "url": "/v1/chat/completions",
                        "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True,
                                 "top_logprobs": 25}},
             {"custom_id": "e", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "abc", "max_tokens": 2, "logprobs": 12}}]
    runner = TaskRunner(wide, LLMEngine(EngineConfig(model="builtin:tiny", max_logprobs=32)))
    out = [json.loads(x) for x in runner.openai_lines(Row.batch(lines, ["c", "d", "e"]), runner.run(Row.batch(lines, ["c", "d", "e"])), 1700000000)]
    assert len(out[0]["response"]["body"]["prompt_logprobs"][1]) >= 30
    chosen = out[1]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(chosen) == 2 and all(len(t["top_logprobs"]) == 25 for t in chosen)
    # (completions key the alternatives by their text: byte tokens decode alike, so fewer keys than 12)
    assert out[2]["response"]["status_code"] == 200 and len(out[2]["response"]["body"]["choices"][0]["logprobs"][
        "top_logprobs"]) == 2


def test_a_rows_nested_sampling_params_survive_arrows_merge_of_a_batchs_structs():
    """Arrow gives every row the union of the batch's struct keys, null where a row has none: the
    nulls are dropped at every depth, so each row keeps its own logit_bias and schema."""
    import pyarrow as pa

    from pipeline.spec.row_sampling import row_sampling

    job = validate(BASE).sampling
    rows = pa.Table.from_pylist([
        {"sampling_params": {"logit_bias": {"5": 1.0}, "structured_outputs": {"json": {"type": "object"}}}},
        {"sampling_params": {"logit_bias": {"7": -2.0}, "structured_outputs": {"json": {"type": "string",
                                                                                           "maxLength": 5}}}},
    ]).to_pylist()
    assert rows[0]["sampling_params"]["logit_bias"] == {"5": 1.0, "7": None}  # what Arrow hands over
    first, second = (row_sampling(r["sampling_params"], job) for r in rows)
    assert first["logit_bias"] == {5: 1.0} and second["logit_bias"] == {7: -2.0}
    assert first["structured_outputs"].json == {"type": "object"}
    assert second["structured_outputs"].json == {"type": "string", "maxLength": 5}
