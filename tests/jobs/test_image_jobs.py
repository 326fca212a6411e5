"""A job whose rows carry images (input.image_column) on a tiny LLaVA: a Parquet file with a Hugging
Face datasets-style image column ({bytes, path} structs), a crash mid-job and a resume, every id
exactly once with the tokens the engine gives on the same chat messages; the image column stays
out of the output; a bad image (undecodable, a format not read, too thin) fails its row alone."""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from chaos.harness import hook_env  # noqa: E402
from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from helpers import read_output  # noqa: E402
from pipeline.errors import JobError, SpecError  # noqa: E402
from pipeline.run import run_job  # noqa: E402
from pipeline.spec import Job, validate  # noqa: E402
from vlm_models import build_llava, images, png_bytes  # noqa: E402

pytestmark = pytest.mark.usefixtures("ray_local")  # the session's one local Ray (run_job would start its own)

QUESTIONS = ["What is in the picture?", "Describe it.", "What colour is it?", "Read the text.", "How many shapes?"]


def image_rows() -> list[dict]:
    pictures = images()
    rows = [{"row_id": f"r{i}", "question": QUESTIONS[i % 5],
             "image": {"bytes": png_bytes(pictures[i % 5]), "path": f"img{i % 5}.png"}} for i in range(10)]
    rows[7]["image"] = {"bytes": b"not an image at all", "path": "broken.png"}
    # a format Pillow half-supports (it aborted the batch and wedged the engine), and a thin image a
    # processor would blow up to 336x134,400
    rows[8]["image"] = {"bytes": png_bytes(Image.new("RGB", (4, 4)), "DDS"), "path": "texture.dds"}
    rows[9]["image"] = {"bytes": png_bytes(Image.new("RGB", (1, 400))), "path": "thin.png"}
    return rows


BAD = {"r7": "is not an image in a format images are read in", "r8": "is not an image in a format images are read in",
       "r9": "over engine.max_image_aspect_ratio (200)"}


def test_an_image_job_resumes_after_a_crash_with_every_row_once(tmp_path, monkeypatch):
    model = build_llava(tmp_path / "llava")
    rows = image_rows()
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    pq.write_table(pa.table({"row_id": [r["row_id"] for r in rows], "question": [r["question"] for r in rows],
                             "image": pa.array([r["image"] for r in rows], struct)}), tmp_path / "in.parquet")
    spec = {"model": str(model), "input": {"path": str(tmp_path / "in.parquet"), "prompt_column": "question",
                                           "image_column": "image", "id_column": "row_id"},
            "output": {"path": str(tmp_path / "out")}, "engine": {"dtype": "float32", "max_num_seqs": 4},
            "sampling": {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True},
            "workers": {"rows_per_batch": 3, "num": 1}, "max_error_rate": 0.4}
    job = Job.of(validate(spec))
    for key, value in hook_env(f"shard#2:raise:{tmp_path / 'fired'}").items():
        monkeypatch.setenv(key, value)
    with pytest.raises(JobError, match="a worker failed"):
        run_job(job, progress=lambda msg: None)
    result = run_job(job, progress=lambda msg: None)
    assert result.status == "complete" and result.rows == 10 and 0 < result.rows_this_run < 10
    out = read_output(tmp_path / "out")
    assert Counter(out["id"].to_pylist()) == Counter(f"r{i}" for i in range(10))
    assert "image" not in out.column_names and "question" in out.column_names
    got = {r["id"]: r for r in out.to_pylist()}
    for name, why in BAD.items():  # each fails alone, beside good rows of its shard
        assert got[name]["finish_reason"] == "error" and why in got[name]["error"], (name, got[name]["error"])
    llm = LLMEngine(EngineConfig(model=str(model), dtype="float32", max_num_seqs=4))
    good = [r for r in rows if r["row_id"] not in BAD]
    prompts = [llm.encode_chat([{"role": "user", "content": [{"type": "image", "image": r["image"]},
                                                             {"type": "text", "text": r["question"]}]}])
               for r in good]
    want = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for r, w in zip(good, want):
        assert got[r["row_id"]]["error"] is None and got[r["row_id"]]["generated_text"] == w.text


def test_image_columns_are_refused_where_they_cannot_run(tmp_path):
    base = {"model": "builtin:tiny", "input": {"path": str(tmp_path / "in.jsonl"), "image_column": "image"},
            "output": {"path": str(tmp_path / "out")}}
    with pytest.raises(SpecError, match="input.image_column puts a row's images before its prompt text"):
        validate({**base, "input": {**base["input"], "messages_column": "messages"}})
    with pytest.raises(SpecError, match="images run in generate, label and eval jobs, not task embed"):
        validate({**base, "task": "embed"})
    assert validate({**base, "task": "label", "label": {"choices": ["yes", "no"]}}).input.image_column == "image"
    assert validate(base).input.image_column == "image"


def test_validate_decodes_the_first_rows_image(tmp_path):
    from pipeline.run.checks.preflight import preflight

    model = build_llava(tmp_path / "llava")
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    for name, first in (("good", png_bytes(images()[0])), ("bad", b"GIF89a but not really")):
        pq.write_table(pa.table({"question": ["What?"], "image": pa.array([{"bytes": first, "path": "x"}], struct)}),
                       tmp_path / f"{name}.parquet")
    spec = {"model": str(model), "input": {"path": str(tmp_path / "good.parquet"), "prompt_column": "question",
                                           "image_column": "image"}, "output": {"path": str(tmp_path / "out")}}
    assert preflight(validate(spec))
    spec["input"]["path"] = str(tmp_path / "bad.parquet")
    with pytest.raises(JobError, match=r"input.image_column 'image': the first row of bad.parquet holds no readable "
                                       r"image: .* does not decode|is not an image"):
        preflight(validate(spec))
    spec["input"]["image_column"] = "picture"
    with pytest.raises(JobError, match="input column 'picture' not found"):
        preflight(validate(spec))


@pytest.mark.slow  # fast siblings: the line parser's image_url tests (test_openai_batch) and LLM.chat's (test_images)
def test_openai_batch_lines_with_image_url_parts(tmp_path):
    import json

    from vlm_models import data_url

    model = build_llava(tmp_path / "llava")
    pictures = images()
    lines = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "llava", "max_tokens": 6, "temperature": 0,
                       "messages": [{"role": "user", "content": [
                           {"type": "image_url", "image_url": {"url": data_url(pictures[i])}},
                           {"type": "text", "text": QUESTIONS[i]}]}]}} for i in range(3)]
    lines.append({"custom_id": "req-bad", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "llava", "max_tokens": 6, "messages": [{"role": "user", "content": [
                      {"type": "image_url", "image_url": {"url": "https://example.com/x.png"}},
                      {"type": "text", "text": "hi"}]}]}})
    (tmp_path / "batch.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    spec = {"model": str(model), "input": {"path": str(tmp_path / "batch.jsonl"), "format": "openai_batch"},
            "output": {"path": str(tmp_path / "out")}, "engine": {"dtype": "float32"},
            "sampling": {"ignore_eos": True}, "max_error_rate": 0.5}
    result = run_job(Job.of(validate(spec)), progress=lambda msg: None)
    assert result.status == "complete" and result.rows == 4
    got = {r["id"]: r for r in read_output(tmp_path / "out").to_pylist()}
    assert "host 'example.com' is not in engine.allowed_media_domains" in got["req-bad"]["error"]
    llm = LLMEngine(EngineConfig(model=str(model), dtype="float32"))
    for i, line in enumerate(lines[:3]):
        want = llm.generate(llm.encode_chat(line["body"]["messages"]),
                            SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
        assert got[f"req-{i}"]["error"] is None and got[f"req-{i}"]["generated_text"] == want.text


@pytest.mark.slow  # fast sibling: test_images' choice scores over an image against transformers
def test_a_label_job_scores_choices_over_each_rows_image(tmp_path):
    model = build_llava(tmp_path / "llava")
    rows = image_rows()[:6]
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    pq.write_table(pa.table({"row_id": [r["row_id"] for r in rows], "question": ["What colour?"] * 6,
                             "image": pa.array([r["image"] for r in rows], struct)}), tmp_path / "in.parquet")
    choices = ["red", "blue", "green"]
    spec = {"model": str(model), "task": "label", "label": {"choices": choices},
            "input": {"path": str(tmp_path / "in.parquet"), "prompt_column": "question", "image_column": "image",
                      "id_column": "row_id"}, "output": {"path": str(tmp_path / "out")},
            "engine": {"dtype": "float32"}, "workers": {"num": 1}}
    result = run_job(Job.of(validate(spec)), progress=lambda msg: None)
    assert result.status == "complete" and result.rows == 6
    got = {r["id"]: r for r in read_output(tmp_path / "out").to_pylist()}
    llm = LLMEngine(EngineConfig(model=str(model), dtype="float32"))
    prompts = [llm.encode_chat([{"role": "user", "content": [{"type": "image", "image": r["image"]},
                                                             {"type": "text", "text": "What colour?"}]}])
               for r in rows]
    for r, scores in zip(rows, llm.score_choices(prompts, [choices] * 6)):
        best = choices[max(range(3), key=scores.logprobs.__getitem__)]
        assert got[r["row_id"]]["label"] == best and got[r["row_id"]]["error"] is None
    assert len({tuple(got[r["row_id"]]["label_logprobs"]) for r in rows}) > 1  # the images change the scores
