"""Jobs on the real default model (builtin:smollm2-135m-instruct): an eval job choosing a sentiment
label by log-likelihood is right well above chance (the lower bound of metrics.json's interval),
and a JSON-schema job's rows are valid for their schema (checked again here by jsonschema), the
rest carrying the violation as their error."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from helpers import read_output, write_jsonl

from engine import VIOLATION
from pipeline.run import run_job
from pipeline.spec import Job, validate

pytestmark = pytest.mark.usefixtures("ray_local")
DATA = Path(__file__).resolve().parents[1] / "data"
MODEL = "builtin:smollm2-135m-instruct"


@pytest.mark.slow
def test_an_eval_job_labels_real_sentiment_well_above_chance(tmp_path):
    rows = [json.loads(line) for line in (DATA / "sentiment.jsonl").read_text().splitlines()]
    assert len(rows) >= 60 and sum(r["sentiment"] == "positive" for r in rows) == len(rows) // 2
    spec = {"model": MODEL, "task": "eval",
            "input": {"path": str(DATA / "sentiment.jsonl"), "id_column": "id",
                      "template": "Is the sentiment of this review positive or negative?\nReview: {review}\nAnswer:"},
            "output": {"path": str(tmp_path / "out")}, "label": {"choices": ["positive", "negative"]},
            "eval": {"reference_column": "sentiment", "metrics": ["accuracy"]}, "workers": {"num": 1}}
    result = run_job(Job.of(validate(spec)), progress=lambda msg: None)
    assert result.status == "complete" and result.rows == len(rows)
    accuracy = json.loads((tmp_path / "out" / "metrics.json").read_text())["metrics"]["accuracy"]
    assert accuracy["count"] == len(rows) and accuracy["ci95"][0] > 0.5, accuracy
    engines = json.loads((tmp_path / "out" / "manifest.json").read_text())["engines"]
    assert engines[0]["gguf"]["file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"  # what the rows were generated from
    assert len(engines[0]["gguf"]["digest"]) == 64 and engines[0]["gguf"]["tensor_types"]["Q4_1"] == 210


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                                           "population_millions": {"type": "number"}},
          "required": ["city", "country"], "additionalProperties": False}


@pytest.mark.slow
def test_a_json_schema_job_on_the_real_model_gives_valid_rows(tmp_path):
    cities = ["Paris", "Tokyo", "Cairo", "Lima", "Oslo", "Delhi", "Rome", "Seoul", "Quito", "Nairobi",
              "Madrid", "Hanoi"]
    write_jsonl(tmp_path / "in.jsonl", [{"id": f"c{i:02d}", "messages": [
        {"role": "user", "content": f"Give the city, country and population in millions of {c} as JSON."}]}
        for i, c in enumerate(cities)])
    spec = {"model": MODEL, "input": {"path": str(tmp_path / "in.jsonl"), "messages_column": "messages",
                                      "id_column": "id"},
            "output": {"path": str(tmp_path / "out")}, "max_error_rate": 1.0, "workers": {"num": 1},
            "sampling": {"max_tokens": 48, "temperature": 0.0,
                         "structured_outputs": {"json": SCHEMA}}}
    result = run_job(Job.of(validate(spec)), progress=lambda msg: None)
    assert result.rows == len(cities)
    out = read_output(tmp_path / "out").to_pylist()
    valid = 0
    for row in out:
        if row["error"] is None:
            jsonschema.validate(json.loads(row["generated_text"]), SCHEMA)
            valid += 1
        else:
            assert row["error"].startswith(VIOLATION), row["error"]
    assert valid >= 0.95 * len(cities), [r["error"] for r in out if r["error"]]
    assert any(json.loads(r["generated_text"])["city"] == "Paris" for r in out if r["error"] is None)
