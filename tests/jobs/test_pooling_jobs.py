"""Jobs of task embed, classify and score: a crash mid-job, a resume, every row exactly once with
the values the engine gives; classify's accuracy in metrics.json; build_processor's same rows."""
from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from chaos.harness import hook_env  # noqa: E402
from engine import LLMEngine  # noqa: E402
from helpers import read_output, write_jsonl  # noqa: E402
from pipeline import build_processor  # noqa: E402
from pipeline.errors import JobError, SpecError  # noqa: E402
from pipeline.run import run_job  # noqa: E402
from pipeline.spec import Job, validate  # noqa: E402
from pooling_models import LABELS, build_classifier, build_encoder, build_sentence_transformer, texts  # noqa: E402

pytest.importorskip("sentence_transformers")
pytestmark = pytest.mark.usefixtures("ray_local")  # the session's one local Ray (run_job would start its own)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("pooling_jobs")
    return {"embed": build_sentence_transformer(root / "st", build_encoder(root / "bert"), "mean"),
            "classify": build_classifier(root / "cls", "bert"),
            "score": build_classifier(root / "cross", "bert", num_labels=1)}


def rows_for(task: str) -> list[dict]:
    a, b = texts(10, seed=4, lo=1, hi=80), texts(10, seed=5, lo=1, hi=80)
    if task == "score":
        return [{"query": x, "doc": y} for x, y in zip(a, b)]
    return [{"prompt": x, "answer": LABELS[i % 3]} for i, x in enumerate(a)]


def spec_for(task: str, model: Path, inp: Path, out: Path) -> dict:
    spec = {"task": task, "model": str(model), "input": {"path": str(inp)}, "output": {"path": str(out)},
            "workers": {"rows_per_batch": 3, "num": 1}}
    if task == "score":
        spec["score"] = {"text_1_column": "query", "text_2_column": "doc"}
    if task == "classify":
        spec["eval"] = {"reference_column": "answer"}
    return spec


def cpus_free_within(seconds: float) -> bool:
    import ray

    deadline = time.time() + seconds
    while ray.available_resources().get("CPU", 0.0) < ray.cluster_resources()["CPU"]:
        if time.time() > deadline:
            return False
        time.sleep(0.5)
    return True


@pytest.mark.parametrize("task", [pytest.param("embed", marks=pytest.mark.slow), "classify",
                                  pytest.param("score", marks=pytest.mark.slow)])
def test_a_pooling_job_resumes_after_a_crash_with_every_row_once(tmp_path, models, monkeypatch, task):
    rows = rows_for(task)
    write_jsonl(tmp_path / "in.jsonl", rows)
    spec = spec_for(task, models[task], tmp_path / "in.jsonl", tmp_path / "out")
    job = Job.of(validate(spec))
    for key, value in hook_env(f"shard#2:raise:{tmp_path / 'fired'}").items():
        monkeypatch.setenv(key, value)
    with pytest.raises(JobError, match="a worker failed") as failed:
        run_job(job, progress=lambda msg: None)
    # the failed job's engine actor is gone while its caller still holds the error
    assert failed.value.__cause__ is not None and cpus_free_within(30.0)
    result = run_job(job, progress=lambda msg: None)
    assert result.status == "complete" and result.rows == 10 and 0 < result.rows_this_run < 10
    out = read_output(tmp_path / "out")
    assert Counter(out["id"].to_pylist()) == Counter(f"in.jsonl:{i}" for i in range(10))
    got = sorted(out.to_pylist(), key=lambda r: int(r["id"].split(":")[1]))
    assert all(r["error"] is None and r["finish_reason"] == "stop" and r["num_generated_tokens"] == 0 for r in got)
    llm = LLMEngine(model=str(models[task]))
    if task == "embed":
        assert out.schema.field("embedding").type == pa.list_(pa.float32(), 32)
        want = llm.embed([r["prompt"] for r in rows])
        for r, w in zip(got, want):
            assert r["embedding"] == pytest.approx(w.embedding, abs=1e-6)
            assert r["num_prompt_tokens"] == w.num_prompt_tokens
    elif task == "classify":
        want = llm.classify([r["prompt"] for r in rows])
        assert [r["class_label"] for r in got] == [w.label for w in want]
        assert all(r["class_probs"] == pytest.approx(w.probs, abs=1e-6) for r, w in zip(got, want))
        metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
        hits = sum(w.label == r["answer"] for w, r in zip(want, rows))
        assert metrics["metrics"]["accuracy"]["sum"] == hits and metrics["rows"] == 10
    else:
        assert out.schema.field("score").type == pa.float64()
        want = llm.score([r["query"] for r in rows], [r["doc"] for r in rows])
        assert [r["score"] for r in got] == pytest.approx([w.score for w in want], abs=1e-6)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["prompt_tokens"] == sum(r["num_prompt_tokens"] for r in got) and manifest["generated_tokens"] == 0


def test_build_processor_gives_the_same_embeddings(models):
    import ray

    rows = rows_for("embed")[:4]
    processor = build_processor({"task": "embed", "model": str(models["embed"])})
    got = sorted(processor(ray.data.from_items([{"id": str(i), **r} for i, r in enumerate(rows)])).take_all(),
                 key=lambda r: int(r["id"]))
    want = LLMEngine(model=str(models["embed"])).embed([r["prompt"] for r in rows])
    assert [list(r["embedding"]) for r in got] == [pytest.approx(w.embedding, abs=1e-6) for w in want]


def test_pooling_spec_errors(models, tmp_path):
    base = {"input": {"path": "x.jsonl"}, "output": {"path": str(tmp_path / "o")}}
    with pytest.raises(SpecError, match="sampling.n"):
        validate({**base, "task": "embed", "sampling": {"n": 2}})
    with pytest.raises(SpecError, match="embed and score sections"):
        validate({**base, "task": "generate", "embed": {"dimensions": 8}})
    with pytest.raises(SpecError, match="two columns"):
        validate({**base, "task": "score", "score": {"text_1_column": "a", "text_2_column": "a"}})
    old = validate({**base, "task": "generate"}).fingerprint()
    assert validate({**base, "task": "generate", "embed": {}}).fingerprint() == old  # unset sections count not


@pytest.mark.slow  # fast sibling: tests/pipeline/test_openai_pooling.py (the same lines through TaskRunner)
def test_an_openai_batch_file_of_embedding_lines(tmp_path, models):
    from openai.types import CreateEmbeddingResponse

    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings", "body": {"input": t}}
             for i, t in enumerate(texts(4, seed=6, lo=1, hi=40))]
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/embeddings", "body": {"input": ""}})
    write_jsonl(tmp_path / "req.jsonl", lines)
    job = Job.of(validate({"model": str(models["embed"]), "max_error_rate": 1,
                           "input": {"path": str(tmp_path / "req.jsonl"), "format": "openai_batch"},
                           "output": {"path": str(tmp_path / "out"), "format": "openai_batch"}}))
    assert run_job(job, progress=lambda msg: None).status == "complete"
    out = [json.loads(x) for x in (tmp_path / "out" / "output.jsonl").read_text().splitlines()]
    errors = [json.loads(x) for x in (tmp_path / "out" / "errors.jsonl").read_text().splitlines()]
    assert [e["custom_id"] for e in errors] == ["bad"]
    out = [x for x in out if x["error"] is None]
    assert sorted(x["custom_id"] for x in out) == ["e0", "e1", "e2", "e3"]
    want = LLMEngine(model=str(models["embed"])).embed([x["body"]["input"] for x in lines[:4]])
    for x in out:
        body = CreateEmbeddingResponse.model_validate(x["response"]["body"])
        assert body.data[0].embedding == pytest.approx(want[int(x["custom_id"][1:])].embedding, abs=1e-6)


def test_embed_with_chat_messages_fails_an_over_long_conversation_alone(tmp_path, models):
    import shutil

    model = tmp_path / "chat-encoder"
    shutil.copytree(models["embed"], model)
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                                               "{% endfor %}")
    rows = [{"messages": [{"role": "user", "content": text}]} for text in texts(4, seed=6, lo=1, hi=20)]
    rows.insert(2, {"messages": [{"role": "user", "content": "long " * 2000}]})
    rows.append({"messages": [{"role": "user", "content": "x" * 100_000}]})  # refused as it is rendered
    write_jsonl(tmp_path / "in.jsonl", rows)
    spec = spec_for("embed", model, tmp_path / "in.jsonl", tmp_path / "out")
    spec["input"]["messages_column"] = "messages"
    spec["workers"]["rows_per_batch"] = 6  # the long conversations share their batch with every other row
    spec["max_error_rate"] = 1
    result = run_job(Job.of(validate(spec)), progress=lambda msg: None)
    assert result.status == "complete"
    got = {r["id"]: r for r in read_output(tmp_path / "out").to_pylist()}
    assert "more than the model's limit of 512" in got["in.jsonl:2"]["error"] and "\n" not in got["in.jsonl:2"]["error"]
    assert got["in.jsonl:5"]["error"] == ("prompt is 100007 characters, more than max_model_len (512 tokens) can "
                                          "hold: refused before tokenizing")
    assert all(got[f"in.jsonl:{i}"]["error"] is None and got[f"in.jsonl:{i}"]["embedding"] for i in (0, 1, 3, 4))
