"""Tasks end to end through the CLI: chat prompts, labels (scored and parsed), eval metrics,
OpenAI Batch files in and out."""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from click.testing import CliRunner

from engine import EngineConfig, LLMEngine
from engine.models.builtin import builtin_path
from helpers import read_output, write_jsonl
from jobs.cli import main

pytestmark = pytest.mark.usefixtures("ray_local")


def run(*args):
    result = CliRunner().invoke(main, ["run", *map(str, args)], catch_exceptions=False)
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def tiny():
    return LLMEngine(EngineConfig(model="builtin:tiny"))


# -- chat prompts ---------------------------------------------------------------------------------

def test_messages_column_with_system_prompt_and_few_shot(tmp_path, tiny):
    convo = [{"role": "user", "content": "What is 2+2?"}]
    rows = [{"id": "a", "messages": convo},
            {"id": "b", "messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}]}]},
            {"id": "c", "messages": "not a list"},
            {"id": "d", "messages": [{"role": "wizard", "content": "hi"}]}]
    write_jsonl(tmp_path / "in.jsonl", rows)
    spec = tmp_path / "job.yaml"
    spec.write_text(f"""
model: builtin:tiny
input: {{path: {tmp_path / 'in.jsonl'}, messages_column: messages, id_column: id,
        system_prompt: "Answer briefly.", few_shot: [{{user: "1+1?", assistant: "2"}}]}}
output: {{path: {tmp_path / 'out'}}}
sampling: {{max_tokens: 4}}
max_error_rate: 0.5
""")
    code, text = run(spec)
    assert code == 0, text
    out = {r["id"]: r for r in read_output(tmp_path / "out").to_pylist()}
    expected = tiny.tokenizer.encode_chat([{"role": "system", "content": "Answer briefly."},
                                           {"role": "user", "content": "1+1?"},
                                           {"role": "assistant", "content": "2"}] + convo)
    assert out["a"]["num_prompt_tokens"] == len(expected) and out["a"]["finish_reason"] != "error"
    assert out["b"]["finish_reason"] != "error"
    assert out["c"]["finish_reason"] == "error" and "messages must be a non-empty list" in out["c"]["error"]
    assert "role must be one of" in out["d"]["error"]


def test_chat_prompts_need_a_chat_template(tmp_path):
    model = tmp_path / "no-template"
    shutil.copytree(builtin_path("builtin:tiny"), model)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hi"}])
    code, text = run("--model", model, "--input", tmp_path / "in.jsonl", "--output", tmp_path / "out",
                     "--set", "input.system_prompt=Be nice.")
    assert code == 1 and "no chat template" in text


# -- label ----------------------------------------------------------------------------------------

def loglik(model, prompt_ids, choice_ids) -> float:
    x = torch.tensor([prompt_ids + choice_ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(x).logits[0].float(), dim=-1)
    return sum(float(lp[len(prompt_ids) - 1 + j, t]) for j, t in enumerate(choice_ids))


def test_label_by_choice_scoring_is_the_argmax_of_transformers_loglikelihoods(tmp_path, tiny):
    from transformers import AutoModelForCausalLM

    prompts = [f"Review {i}: {'great' if i % 2 else 'awful'} stuff. Sentiment:" for i in range(6)]
    write_jsonl(tmp_path / "in.jsonl", [{"text": p, "opts": ["yes", "no", "maybe"]} for p in prompts])
    choices = ["positive", "negative", "neutral"]
    code, text = run("--model", "builtin:tiny", "--input", tmp_path / "in.jsonl", "--output", tmp_path / "out", "--set", "task=label",
                     "--set", "input.prompt_column=text", "--set", f"label.choices={json.dumps(choices)}")
    assert code == 0, text
    rows = read_output(tmp_path / "out").to_pylist()
    ref = AutoModelForCausalLM.from_pretrained(builtin_path("builtin:tiny"), dtype=torch.float32).eval()
    for row in rows:
        pids = tiny.tokenizer.encode(row["text"])
        expected = [loglik(ref, pids, tiny.tokenizer.encode_continuation(" " + c)) for c in choices]
        assert row["label"] == choices[max(range(3), key=expected.__getitem__)]
        assert row["label_logprobs"] == pytest.approx(expected, abs=1e-4)
        assert sum(row["label_probs"]) == pytest.approx(1.0)
        assert row["label_probs"] == pytest.approx([math.exp(e - max(expected)) / sum(math.exp(x - max(expected))
                                                     for x in expected) for e in expected], rel=1e-3)
        assert row["generated_text"] == row["label"] and row["num_generated_tokens"] == 0

    # per-row choices from a column, picked by mean log-likelihood per token
    code, text = run("--model", "builtin:tiny", "--input", tmp_path / "in.jsonl", "--output", tmp_path / "out2", "--set", "task=label",
                     "--set", "input.prompt_column=text", "--set", "label.choices_column=opts",
                     "--set", "label.length_normalize=true")
    assert code == 0, text
    for row in read_output(tmp_path / "out2").to_pylist():
        per_token = row["label_logprobs_per_token"]
        assert row["label"] == ["yes", "no", "maybe"][max(range(3), key=per_token.__getitem__)]


def test_label_regex_parses_generated_text_and_notes_misses(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"row {i}"} for i in range(4)])
    common = ("--model", "builtin:echo", "--input", tmp_path / "in.jsonl", "--set", "task=label", "--set", "sampling.max_tokens=4",
              "--set", "sampling.ignore_eos=true")
    code, text = run(*common, "--output", tmp_path / "hit", "--set", "label.label_regex='(?s)^(.)'")
    assert code == 0, text
    for row in read_output(tmp_path / "hit").to_pylist():
        assert row["label"] == row["generated_text"][0] and row["error"] is None
    code, text = run(*common, "--output", tmp_path / "miss", "--set", "label.label_regex='(?!x)x'")
    assert code == 0, text  # a miss is a note, not a failed row
    for row in read_output(tmp_path / "miss").to_pylist():
        assert row["label"] is None and row["error"] == "label_regex did not match the generated text"
        assert row["finish_reason"] == "length"


# -- eval -----------------------------------------------------------------------------------------

def wilson(successes: int, n: int) -> list[float]:
    z = 1.959963984540054
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [round(max(0.0, centre - half), 6), round(min(1.0, centre + half), 6)]


def entry(successes: int, n: int, unscored: int) -> dict:
    return {"mean": round(successes / n, 6), "count": n, "sum": float(successes), "unscored": unscored,
            "ci95": wilson(successes, n), "ci_method": "wilson"}


def test_eval_metrics_file_is_exact_and_a_resumed_job_reports_the_same(tmp_path):
    prompts = [f"question {i}?" for i in range(8)]
    write_jsonl(tmp_path / "gen.jsonl", [{"prompt": p} for p in prompts])
    sampling = ("--set", "sampling.max_tokens=3", "--set", "sampling.ignore_eos=true", "--set", "sampling.temperature=0")
    code, text = run("--model", "builtin:echo", "--input", tmp_path / "gen.jsonl", "--output", tmp_path / "gen", *sampling)
    assert code == 0, text
    outputs = {r["id"]: r["generated_text"] for r in read_output(tmp_path / "gen").to_pylist()}
    answers = [outputs[f"gen.jsonl:{i}"] for i in range(8)]
    # rows 3 and 6 answered wrongly, row 7 has no reference; groups A (0-3) and B (4-7)
    refs = answers[:3] + ["nope"] + answers[4:6] + ["nope", None]
    rows = [{"prompt": p, "answer": r, "topic": "A" if i < 4 else "B"} for i, (p, r) in enumerate(zip(prompts, refs))]
    write_jsonl(tmp_path / "eval" / "eval.jsonl", rows)
    args = ("--model", "builtin:echo", "--input", tmp_path / "eval", "--output", tmp_path / "out", "--set", "task=eval",
            "--set", "eval.reference_column=answer", "--set", "eval.group_column=topic",
            "--set", "workers.rows_per_batch=3", *sampling)
    code, text = run(*args)
    assert code == 0, text
    expected = {"rows": 8, "metrics": {"exact_match": entry(5, 7, 1)}, "group_column": "topic",
                "groups": {"A": {"rows": 4, "metrics": {"exact_match": entry(3, 4, 0)}},
                           "B": {"rows": 4, "metrics": {"exact_match": entry(2, 3, 1)}}}}
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics == expected
    assert "exact_match" in text and "0.7143" in text
    table = read_output(tmp_path / "out").to_pylist()
    assert [r["score_exact_match"] for r in table] == [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, None]

    # a crash after some shards: the rerun recomputes one part, and reports the same numbers
    for name in ("_SUCCESS", "manifest.json", "metrics.json"):
        (tmp_path / "out" / name).unlink()
    part = sorted((tmp_path / "out" / "data").iterdir())[0]
    part.unlink()
    (tmp_path / "out" / "_progress" / (part.name[len("part-"):].split(".")[0] + ".json")).unlink()
    code, text = run(*args)
    assert code == 0, text
    assert json.loads((tmp_path / "out" / "metrics.json").read_text()) == expected


# -- OpenAI Batch ---------------------------------------------------------------------------------

def batch_lines():
    chat = {"model": "my-model", "messages": [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Hello?"}], "max_tokens": 5}
    return [
        {"custom_id": "req-chat", "method": "POST", "url": "/v1/chat/completions", "body": chat},
        {"custom_id": "req-text", "method": "POST", "url": "/v1/completions",
         "body": {"model": "m", "prompt": "Once upon", "max_tokens": 3, "temperature": 0.7, "seed": 1}},
        {"custom_id": "req-unknown", "method": "POST", "url": "/v1/chat/completions",
         "body": {**chat, "parallel_tool_calls": True}},
        {"custom_id": "req-n", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "x", "n": 3, "max_tokens": 3, "temperature": 1.0, "seed": 5, "logprobs": 0}},
        {"custom_id": "req-n-bad", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "x", "n": 200}},
        {"custom_id": "req-url", "method": "POST", "url": "/v1/moderations", "body": {"input": "x"}},
        {"custom_id": "req-logprobs", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": chat["messages"], "logprobs": True, "top_logprobs": 2, "max_completion_tokens": 4}},
    ]


def check_batch_output(lines: list[dict], errors: list[dict]) -> None:
    from openai.types import BatchError, Completion
    from openai.types.chat import ChatCompletion

    assert [line["custom_id"] for line in lines] == ["req-chat", "req-text", "req-unknown", "req-n", "req-n-bad",
                                                     "req-url", "req-logprobs"]
    chat = ChatCompletion.model_validate(lines[0]["response"]["body"])
    assert chat.model == "my-model" and chat.usage.completion_tokens <= 5
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason in ("stop", "length")
    text = Completion.model_validate(lines[1]["response"]["body"])
    assert text.usage.completion_tokens <= 3 and isinstance(text.choices[0].text, str)
    assert lines[0]["response"]["status_code"] == 200 and lines[0]["error"] is None
    failed = [line for line in lines if line["error"] is not None]
    assert [line["custom_id"] for line in failed] == ["req-unknown", "req-n-bad", "req-url"]
    assert all(line["response"] is None for line in failed)
    assert "parallel_tool_calls" in failed[0]["error"]["message"]
    assert failed[1]["error"]["message"] == "body.n must be in [1, 128], got 200"
    sampled = Completion.model_validate(lines[3]["response"]["body"])  # n = 3: one line, three choices
    assert [c.index for c in sampled.choices] == [0, 1, 2] and len({c.text for c in sampled.choices}) > 1
    assert sampled.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in sampled.choices) > 3
    for line in failed:
        BatchError.model_validate(line["error"])
    assert errors == failed
    with_logprobs = ChatCompletion.model_validate(lines[6]["response"]["body"])
    tokens = with_logprobs.choices[0].logprobs.content
    assert len(tokens) == with_logprobs.usage.completion_tokens <= 4
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in tokens)


@pytest.mark.slow  # its fast sibling: test_openai_batch_on_object_storage checks the same lines through S3
def test_openai_batch_file_in_and_out(tmp_path):
    write_jsonl(tmp_path / "requests.jsonl", batch_lines())
    args = ("--model", "builtin:tiny", "--input", tmp_path / "requests.jsonl", "--output", tmp_path / "out", "--set", "input.format=openai_batch",
            "--set", "output.format=openai_batch", "--set", "max_error_rate=1")
    code, text = run(*args)
    assert code == 0, text
    out = tmp_path / "out"
    lines = [json.loads(x) for x in (out / "output.jsonl").read_text().splitlines()]
    errors = [json.loads(x) for x in (out / "errors.jsonl").read_text().splitlines()]
    check_batch_output(lines, errors)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["openai_batch"]["request_counts"] == {"total": 7, "completed": 4, "failed": 3}
    assert manifest["errors"] == 3 and manifest["rows"] == 7 and "4 completed, 3 failed" in text

    # a rerun from scratch writes the same lines (ids are derived from custom_id)
    code, _ = run(*args, "--overwrite")
    assert code == 0
    again = [json.loads(x) for x in (out / "output.jsonl").read_text().splitlines()]
    assert without_created(again) == without_created(lines)


def without_created(lines: list[dict]) -> list[dict]:
    for line in lines:
        if line["response"]:
            line["response"]["body"].pop("created")
    return lines


def test_duplicate_custom_id_is_fatal_and_named(tmp_path):
    lines = batch_lines()[:2]
    lines[1]["custom_id"] = "req-chat"
    write_jsonl(tmp_path / "requests.jsonl", lines)
    code, text = run("--model", "builtin:echo", "--input", tmp_path / "requests.jsonl", "--output", tmp_path / "out",
                     "--set", "input.format=openai_batch")
    assert code == 1 and "req-chat" in text and "duplicate" in text


def test_openai_batch_on_object_storage(tmp_path, s3_server):
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server})
    fs.mkdir("batchinfer-openai")
    fs.pipe("batchinfer-openai/requests.jsonl", "".join(json.dumps(x) + "\n" for x in batch_lines()).encode())
    code, text = run("--model", "builtin:tiny", "--input", "s3://batchinfer-openai/requests.jsonl", "--output", "s3://batchinfer-openai/out/",
                     "--set", "input.format=openai_batch", "--set", "output.format=openai_batch",
                     "--set", "max_error_rate=1")
    assert code == 0, text
    lines = [json.loads(x) for x in fs.cat("batchinfer-openai/out/output.jsonl").decode().splitlines()]
    errors = [json.loads(x) for x in fs.cat("batchinfer-openai/out/errors.jsonl").decode().splitlines()]
    check_batch_output(lines, errors)


SHIPPED = ["chat", "label", "eval", "openai_batch"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_task_configs_validate(name, tmp_path, monkeypatch):
    """docs/tasks.md's examples pass every check of a run (spec, inputs, model, output): the fast
    sibling of running them whole below."""
    from pathlib import Path

    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    result = CliRunner().invoke(main, ["validate", f"configs/{name}.yaml", "--output", str(tmp_path / "out")])
    assert result.exit_code == 0 and "ok: " in result.output, result.output


@pytest.mark.slow
@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_task_configs_run(name, tmp_path, monkeypatch):
    """docs/tasks.md's examples work as written (output redirected)."""
    from pathlib import Path

    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    code, text = run(f"configs/{name}.yaml", "--output", tmp_path / "out", "--set", "max_error_rate=1")
    assert code == 0, text
    assert (tmp_path / "out" / "_SUCCESS").exists()
    if name == "eval":
        assert set(json.loads((tmp_path / "out" / "metrics.json").read_text())["groups"]) == {
            "arithmetic", "geography", "language"}
    if name == "openai_batch":
        assert len((tmp_path / "out" / "output.jsonl").read_text().splitlines()) == 4


def test_a_row_the_chat_template_refuses_is_that_rows_error(tmp_path):
    model = tmp_path / "strict-template"
    shutil.copytree(builtin_path("builtin:tiny"), model)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('system role not supported') }}"
        "{% endif %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    write_jsonl(tmp_path / "in.jsonl", [{"messages": [{"role": "user", "content": "hi"}]},
                                       {"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}]}])
    code, text = run("--model", model, "--input", tmp_path / "in.jsonl", "--output", tmp_path / "out",
                     "--set", "input.messages_column=messages", "--set", "sampling.max_tokens=3",
                     "--set", "max_error_rate=0.5")
    assert code == 0, text
    rows = read_output(tmp_path / "out").to_pylist()
    assert rows[0]["finish_reason"] != "error"
    assert rows[1]["finish_reason"] == "error" and "system role not supported" in rows[1]["error"]


def test_empty_and_failed_shards_keep_one_schema_and_eval_completes(tmp_path):
    """A shard with no rows, and a shard where every row failed, still write the task's
    columns with their types: the parts read back as one dataset, and metrics.json is written."""
    import pyarrow.dataset as ds

    rows = [{"prompt": "good", "opts": ["a", "b"], "answer": "a"}, {"prompt": "fine", "opts": ["b", "c"], "answer": "c"},
            {"prompt": "bad", "opts": "not a list", "answer": "a"}, {"prompt": "worse", "opts": [], "answer": "b"}]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n\n")  # blank lines: an empty last shard
    code, text = run("--model", "builtin:echo", "--input", path, "--output", tmp_path / "out", "--set", "task=eval",
                     "--set", "label.choices_column=opts", "--set", "eval.reference_column=answer",
                     "--set", "eval.metrics=[accuracy]", "--set", "workers.rows_per_batch=2",
                     "--set", "max_error_rate=1", "--set", "input.columns=[prompt]")
    assert code == 0, text
    assert len(list((tmp_path / "out" / "data").iterdir())) == 3
    table = ds.dataset(tmp_path / "out" / "data", format="parquet").to_table()
    import pyarrow as pa

    assert pa.types.is_list(table.schema.field("label_probs").type)
    assert table.schema.field("label_probs").type.value_type == pa.float64()
    assert table.schema.field("score_accuracy").type == pa.float64()
    assert "answer" in table.column_names  # kept for eval although input.columns leaves it out
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["rows"] == 4 and metrics["metrics"]["accuracy"]["count"] == 2
    assert metrics["metrics"]["accuracy"]["unscored"] == 2
