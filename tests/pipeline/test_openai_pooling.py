"""OpenAI Batch pooling lines: /v1/embeddings answered in OpenAI's shape (read back with the
openai package's types), vLLM's /v1/score and /v1/rerank, and bad or unserved lines failing alone."""
from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from engine import LLMEngine  # noqa: E402
from pipeline.spec import Row, validate  # noqa: E402
from pipeline.tasks import TaskRunner  # noqa: E402
from pipeline.tasks.openai_batch.requests import parse_request  # noqa: E402
from pooling_models import build_classifier, build_encoder, build_sentence_transformer  # noqa: E402

openai_types = pytest.importorskip("openai.types")


def line(custom_id: str, url: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


@pytest.fixture(scope="module")
def st_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("oa_pool")
    return build_sentence_transformer(root / "st", build_encoder(root / "bert"), "mean")


def run_lines(model: Path, lines: list[dict], tmp_path: Path) -> dict[str, dict]:
    spec = validate({"model": str(model), "input": {"path": str(tmp_path / "in.jsonl"), "format": "openai_batch"},
                     "output": {"path": str(tmp_path / "out"), "format": "openai_batch"}})
    llm = LLMEngine(spec.engine_config())
    runner = TaskRunner(spec, llm)
    ids = [x["custom_id"] for x in lines]
    results = runner.run(Row.batch(lines, ids))
    return {json.loads(x)["custom_id"]: json.loads(x) for x in runner.openai_lines(Row.batch(lines, ids), results, 1700000000)}, llm


def test_embedding_lines_read_back_with_the_openai_types(st_model, tmp_path):
    lines = [line("one", "/v1/embeddings", {"input": "the cat sat", "model": "m"}),
             line("many", "/v1/embeddings", {"input": ["a dog", "the cat sat"]}),
             line("ids", "/v1/embeddings", {"input": [2, 20, 40, 3]}),
             line("b64", "/v1/embeddings", {"input": "the cat sat", "encoding_format": "base64"}),
             line("dims", "/v1/embeddings", {"input": "x", "dimensions": 8}),
             line("empty", "/v1/embeddings", {"input": ""}),
             line("moderation", "/v1/moderations", {"input": "x"}),
             line("completion", "/v1/completions", {"prompt": "x"})]
    out, llm = run_lines(st_model, lines, tmp_path)
    want = llm.embed(["the cat sat", "a dog"])
    one = openai_types.CreateEmbeddingResponse.model_validate(out["one"]["response"]["body"])
    assert one.model == "m" and one.data[0].embedding == pytest.approx(want[0].embedding, abs=1e-6)
    assert one.usage.prompt_tokens == want[0].num_prompt_tokens == one.usage.total_tokens
    many = openai_types.CreateEmbeddingResponse.model_validate(out["many"]["response"]["body"])
    assert [d.index for d in many.data] == [0, 1]
    assert many.data[0].embedding == pytest.approx(want[1].embedding, abs=1e-6)
    assert len(openai_types.CreateEmbeddingResponse.model_validate(out["ids"]["response"]["body"]).data) == 1
    raw = out["b64"]["response"]["body"]["data"][0]["embedding"]
    assert np.frombuffer(base64.b64decode(raw), dtype="<f4") == pytest.approx(want[0].embedding, abs=1e-6)
    assert "not a Matryoshka model" in out["dims"]["error"]["message"]
    assert out["empty"]["error"]["code"] == "invalid_request"
    assert "url must be one of" in out["moderation"]["error"]["message"]
    assert "no language-model head" in out["completion"]["error"]["message"]
    assert out["one"]["error"] is None and out["one"]["response"]["status_code"] == 200


def test_score_and_rerank_lines_in_vllms_shape(tmp_path):
    model = build_classifier(tmp_path / "cross", "bert", num_labels=1)
    docs = ["the cat sat", "a dog ran", "it is a test"]
    lines = [line("s", "/v1/score", {"text_1": "a cat", "text_2": docs}),
             line("pairs", "/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d"]}),
             line("bad", "/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}),
             line("r", "/v1/rerank", {"query": "a cat", "documents": docs, "top_n": 2})]
    out, llm = run_lines(model, lines, tmp_path)
    want = [o.score for o in llm.score("a cat", docs)]
    body = out["s"]["response"]["body"]
    assert body["object"] == "list" and [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-6)
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and body["usage"]["prompt_tokens"] > 0
    assert len(out["pairs"]["response"]["body"]["data"]) == 2
    assert "same length" in out["bad"]["error"]["message"]
    results = out["r"]["response"]["body"]["results"]
    best = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in results] == best and results[0]["document"]["text"] == docs[best[0]]
    assert [r["relevance_score"] for r in results] == pytest.approx([want[i] for i in best], abs=1e-6)


def test_pooling_line_errors_are_row_errors():
    assert parse_request(line("x", "/v1/embeddings", {"input": []})).error.startswith("body.input must be")
    assert "encoding_format" in parse_request(line("x", "/v1/embeddings", {"input": "a",
                                                                            "encoding_format": "int8"})).error
    assert "top_n" in parse_request(line("x", "/v1/rerank", {"query": "q", "documents": ["d"], "top_n": 0})).error
    req = parse_request(line("x", "/v1/embeddings", {"input": "a", "foo": 1}))
    assert req.error is None and req.unknown == ["foo"]
