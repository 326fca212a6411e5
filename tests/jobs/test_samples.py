"""A job with sampling.n = 3: three rows per id, the same after a crash and a resume, pass@k and
maj@n in metrics.json and the summary, and build_processor giving the same rows."""
from __future__ import annotations

import json
from collections import Counter

import pyarrow.parquet as pq
import pytest

from chaos.harness import hook_env
from engine import EngineConfig, LLMEngine, SamplingParams
from helpers import read_output, write_jsonl
from jobs.cli import summary_table
from pipeline import build_processor
from pipeline.errors import JobError
from pipeline.run import run_job
from pipeline.run.reporting.sample_metrics import majority
from pipeline.spec import Job, validate
from pipeline.tasks import normalize, row_seed

pytestmark = pytest.mark.usefixtures("ray_local")

N, TOKENS = 3, 2
SECTIONS = {"model": "builtin:tiny", "task": "eval", "sampling": {"n": N, "max_tokens": TOKENS, "temperature": 1.0, "ignore_eos": True},
            "eval": {"reference_column": "answer", "metrics": ["contains"], "group_column": "topic", "k": [1, 2, 3]},
            "engine": {"max_batch_tokens": 2048}, "workers": {"num": 1, "rows_per_batch": 2}}


def expected_samples(prompts: dict[str, str]) -> dict[str, list[str]]:
    """Each row's samples as the engine draws them from the row's seed."""
    llm = LLMEngine(EngineConfig(model="builtin:tiny", max_batch_tokens=2048))
    params = [SamplingParams(n=N, max_tokens=TOKENS, temperature=1.0, ignore_eos=True, seed=row_seed(0, i))
              for i in prompts]
    return {i: [s.text for s in c.samples] for i, c in zip(prompts, llm.generate(list(prompts.values()), params))}


def chen(n: int, c: int, k: int) -> float:
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def test_three_rows_per_id_after_a_crash_and_resume_with_pass_at_k(tmp_path, monkeypatch):
    ids = [f"in.jsonl:{i}" for i in range(6)]  # the ids the job derives (file + line)
    prompts = {i: f"question {j}?" for j, i in enumerate(ids)}
    samples = expected_samples(prompts)
    # references: a sample's own text (c >= 1), one no sample holds (c = 0), "" (every sample contains it: c = n)
    refs = dict(zip(ids, [samples[ids[0]][1], "\x00never", "", samples[ids[3]][0], "\x00never", ""]))
    rows = [{"prompt": prompts[i], "answer": refs[i], "topic": "A" if j < 3 else "B"} for j, i in enumerate(ids)]
    write_jsonl(tmp_path / "in.jsonl", rows)
    job = Job.of(validate({**SECTIONS, "input": {"path": str(tmp_path / "in.jsonl")},
                           "output": {"path": str(tmp_path / "out")}}))

    # the actor fails on its second shard, after the first one committed: the run fails
    for key, value in hook_env(f"shard#2:raise:{tmp_path / 'fired'}").items():
        monkeypatch.setenv(key, value)
    with pytest.raises(JobError, match="a worker failed"):
        run_job(job, progress=lambda msg: None)
    assert (tmp_path / "fired").exists() and not (tmp_path / "out" / "_SUCCESS").exists()
    committed = sorted((tmp_path / "out" / "data").glob("part-*"))
    assert len(committed) == 1 and pq.read_table(committed[0]).num_rows == 2 * N  # whole rows: all their samples

    result = run_job(job, progress=lambda msg: None)  # the resume
    assert result.status == "complete" and result.rows == 6 * N and result.rows_this_run == 4 * N
    parts = [pq.read_table(p) for p in sorted((tmp_path / "out" / "data").glob("part-*"))]
    keys = Counter((i, j) for t in parts for i, j in zip(t["id"].to_pylist(), t["sample_index"].to_pylist()))
    assert keys == Counter({(i, j): 1 for i in prompts for j in range(N)}), "each (id, sample_index) exactly once"
    out = read_output(tmp_path / "out").to_pylist()
    assert {i: [r["generated_text"] for r in sorted(out, key=lambda r: r["sample_index"]) if r["id"] == i]
            for i in prompts} == samples
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["rows"] == 18 and manifest["generated_tokens"] == 18 * TOKENS
    assert manifest["prompt_tokens"] == sum(r["num_prompt_tokens"] for r in out)  # per sample row

    # pass@k and maj@n from the committed rows, computed here
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    entry = metrics["metrics"]["contains"]
    correct = {i: sum(r["score_contains"] for r in out if r["id"] == i) for i in prompts}
    assert [correct[i] for i in ids[1:3]] == [0, N] and [correct[i] for i in ids[4:]] == [0, N] and correct[ids[0]]
    for k in (1, 2, 3):
        assert entry[f"pass@{k}"]["mean"] == round(sum(chen(N, int(c), k) for c in correct.values()) / 6, 6)
    votes = {i: majority([normalize(t) for t in samples[i]]) for i in prompts}
    assert entry["maj@3"]["sum"] == sum(normalize(refs[i]) in votes[i] for i in prompts)
    assert metrics["inputs"] == 6 and metrics["groups"]["A"]["inputs"] == 3
    assert metrics["groups"]["B"]["metrics"]["contains"]["pass@3"]["mean"] == round(2 / 3, 6)  # c >= 1, 0, n
    table = summary_table(result)
    assert "contains pass@2" in table and "contains maj@3" in table

    # build_processor: the same rows from a Dataset
    import ray

    processor = build_processor(SECTIONS)
    got = processor(ray.data.from_items([{"id": i, **row} for i, row in zip(ids, rows)])).take_all()
    key = lambda r: (r["id"], r["sample_index"])  # noqa: E731
    columns = sorted(out[0])
    assert sorted(got[0]) == columns
    assert [[r[c] for c in columns] for r in sorted(got, key=key)] == [[r[c] for c in columns]
                                                                       for r in sorted(out, key=key)]
