"""build_processor: any Dataset in, every row generated out, with a job's columns."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from pipeline import build_processor
from pipeline.errors import SpecError

pytestmark = pytest.mark.timeout(300)

CONFIG = {"model": "builtin:tiny", "sampling": {"max_tokens": 6, "temperature": 0.0},
          "engine": {"max_batch_tokens": 2048}, "workers": {"num": 1, "rows_per_batch": 4}}


@pytest.mark.usefixtures("ray_local")
def test_from_items_rows_come_back_generated_with_a_jobs_columns(tmp_path):
    import ray

    from pipeline.run import run_job
    from pipeline.spec import Job
    from jobs.spec import load_spec

    items = [{"question": f"what is {i}?", "n": i} for i in range(9)] + [{"question": None, "n": 9}]
    processor = build_processor(CONFIG, preprocess=lambda row: {"prompt": row["question"], "n": row["n"]})
    rows = sorted(processor(ray.data.from_items(items)).take_all(), key=lambda r: r["n"])

    assert [r["n"] for r in rows] == list(range(10))
    llm = LLMEngine(EngineConfig(model="builtin:tiny"))
    expected = llm.generate([f"what is {i}?" for i in range(9)], SamplingParams(max_tokens=6, temperature=0.0))
    assert [r["generated_text"] for r in rows[:9]] == [c.text for c in expected]
    assert all(r["finish_reason"] == "length" and r["error"] is None for r in rows[:9])
    assert rows[9]["finish_reason"] == "error" and rows[9]["error"] == "prompt is null"

    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt": r["prompt"], "n": r["n"]}) + "\n" for r in rows))
    spec = load_spec(None, ["sampling.max_tokens=6", "sampling.temperature=0", "engine.max_batch_tokens=2048"],
                     input=str(tmp_path / "in.jsonl"), output=str(tmp_path / "out"))
    run_job(Job(spec, "test"), progress=lambda msg: None)
    part = pq.read_table(next((tmp_path / "out" / "data").glob("part-*.parquet")))
    assert sorted(part.column_names) == sorted(rows[0])  # the same columns as a job's parts


@pytest.mark.usefixtures("ray_local")
def test_read_parquet_chat_messages_label_task_and_postprocess(tmp_path):
    import ray

    reviews = [f"review number {i}" for i in range(7)]
    pq.write_table(pa.table({"review": reviews, "rid": [f"r{i}" for i in range(7)]}), tmp_path / "reviews.parquet")
    processor = build_processor(
        {"model": "builtin:tiny", "task": "label", "label": {"choices": ["good", "bad"]}, "workers": {"rows_per_batch": 3}},
        preprocess=lambda row: {"id": row["rid"], "messages": [{"role": "user", "content": row["review"]}]},
        postprocess=lambda row: {"rid": row["id"], "label": row["label"], "p": float(sum(row["label_probs"]))})
    out = processor(ray.data.read_parquet(str(tmp_path / "reviews.parquet"))).take_all()
    assert sorted(r["rid"] for r in out) == [f"r{i}" for i in range(7)]
    assert all(set(r) == {"rid", "label", "p"} and r["label"] in ("good", "bad") and abs(r["p"] - 1) < 1e-6
               for r in out)


def test_config_is_validated_like_a_job_spec():
    with pytest.raises(SpecError, match="input: not a processor setting"):
        build_processor({"input": {"path": "x"}})
    with pytest.raises(SpecError, match="sampling.max_tokens"):
        build_processor({"sampling": {"max_tokens": "many"}})
    with pytest.raises(SpecError, match="engine.scheduling"):
        build_processor({"engine": {"scheduling": "sometimes"}})
    with pytest.raises(SpecError, match="task label needs label.choices"):
        build_processor({"task": "label"})


def test_row_ids_seed_sampling_so_a_prompt_samples_the_same_tokens():
    from pipeline.processor import row_id

    assert row_id({"prompt": "same"}) == row_id({"prompt": "same", "other": 1}) != row_id({"prompt": "else"})
    assert row_id({"id": 7, "prompt": "same"}) == "7"
    chat = [{"role": "user", "content": "hi"}]
    assert row_id({"messages": chat, "prompt": None}) == row_id({"messages": chat}) != row_id({"prompt": "hi"})


def test_tensor_parallel_size_is_accepted_and_checked_against_the_gpus():
    processor = build_processor({"engine": {"tensor_parallel_size": 2, "device": "cuda"}})
    assert processor.spec.engine.tensor_parallel_size == 2 and processor.spec.workers.gpus == 2
    with pytest.raises(SpecError, match=r"workers.gpus 1 with engine.tensor_parallel_size 2: an actor needs one GPU"):
        build_processor({"engine": {"tensor_parallel_size": 2}, "workers": {"gpus": 1}})
