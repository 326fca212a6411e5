"""Tuning a job mid-run: the settings `batchinfer tune` advises on (max_batch_tokens, max_num_seqs,
scheduling, enforce_eager) never change a row, so they leave the fingerprint, and a half-finished
job resumes with new values, whether its output was written by this version or by one that still
counted them: every row once, the same tokens as an uninterrupted run."""
from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for chaos.*

from chaos.harness import hook_env  # noqa: E402
from helpers import read_output, write_jsonl  # noqa: E402
from pipeline.errors import JobError  # noqa: E402
from pipeline.run import run_job  # noqa: E402
from pipeline.spec import TUNED_FIELDS, Job, resumes, validate  # noqa: E402
from pipeline.spec.fingerprint import fingerprint  # noqa: E402

pytestmark = pytest.mark.usefixtures("ray_local")

BASE = {"model": "builtin:tiny", "input": {"path": "in.jsonl", "template": "{q}"}, "output": {"path": "o"}, "sampling": {"max_tokens": 5},
        "workers": {"rows_per_batch": 256}}
PREVIOUS = {"48fb49df0b1679aa": {"max_num_seqs": 32}, "3e3d293160cfec5b": {"scheduling": "continuous"},
            "22d166dbbcfbaa42": {"max_batch_tokens": 4096}, "19c206f111f1f98c": {"enforce_eager": True},
            "7c296526a11b626d": {"max_num_seqs": 128, "scheduling": "continuous", "max_batch_tokens": 16384,
                                 "enforce_eager": True}}
"""Fingerprints the previous version (2026-12-02, before these settings left it) gave BASE with
these engine settings."""
TUNED = {"max_num_seqs": 3, "scheduling": "continuous", "max_batch_tokens": 2048, "enforce_eager": True}


def test_tuning_settings_leave_the_fingerprint_and_outputs_that_counted_them_resume():
    assert set(TUNED_FIELDS) == set(TUNED)
    for value, engine in PREVIOUS.items():
        spec = validate({**BASE, "engine": engine})
        assert spec.fingerprint() == "25dfd50d5dd2eea4"  # that of BASE, its shard settings at their defaults
        assert value in spec.accepted_fingerprints()
    # an output recorded with other settings than the spec now has: through the spec it recorded
    earlier = validate({**BASE, "engine": PREVIOUS["7c296526a11b626d"]}).model_dump(mode="json")
    assert resumes(validate({**BASE, "engine": TUNED}), earlier | {"fingerprint": "7c296526a11b626d"})
    assert not resumes(validate({**BASE, "sampling": {"max_tokens": 6}}), earlier)  # a row-changing field
    assert not resumes(validate(BASE), None) and not resumes(validate(BASE), {"input": "bad"})


def test_a_resume_keeps_the_shards_its_output_started_with():
    """workers.rows_per_batch and shard_bytes cut the shards, never a row: they leave the
    fingerprint, and the output's plan is the one the spec in its _job.json started it with."""
    from pipeline.io import JobRecord
    from pipeline.io.earlier import read_job_record
    from pipeline.run.shards.planner import ShardPlan, new_plan_record, shard_plan

    started = validate({**BASE, "workers": {"rows_per_batch": 2, "shard_bytes": 4096}})
    record = JobRecord(**new_plan_record(), spec=started.model_dump(mode="json"))
    now = validate({**BASE, "workers": {"rows_per_batch": 5, "shard_bytes": 8192}})
    assert now.fingerprint() == started.fingerprint() == validate({**BASE, "workers": {}}).fingerprint()
    assert shard_plan(now, record) == ShardPlan(2, 4096, record.segment_bytes)
    assert shard_plan(now, JobRecord(**new_plan_record())) == ShardPlan(5, 8192, record.segment_bytes)  # (no spec recorded)
    # an output of 0.1 (rows only, no shard_plan) whose spec recorded 0.1's default of 256 rows
    earlier = read_job_record({"spec": {"workers": {"rows_per_batch": 256}}}, has_parts=True)
    assert shard_plan(validate({**BASE, "workers": {}}), earlier) == ShardPlan(256, None)
    assert "shard_plan" not in earlier.to_dict()  # read so, and written back as it was
    # outputs whose fingerprint counted them: the same settings resume, others only through their spec
    counted = fingerprint(started, planned=False)
    assert counted in started.accepted_fingerprints() and counted not in now.accepted_fingerprints()
    assert resumes(now, started.model_dump(mode="json") | {"fingerprint": counted})


@pytest.mark.slow  # three job runs (~30 s); the fast sibling is the test above
def test_a_half_finished_job_resumes_with_each_tuning_setting_changed(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "in.jsonl", [{"q": f"row {i} " + "x" * i} for i in range(8)])
    spec = {"model": "builtin:tiny", "input": {"path": str(tmp_path / "in.jsonl"), "template": "{q}"}, "sampling": {"max_tokens": 6},
            "workers": {"rows_per_batch": 2}}
    whole = run_job(Job.of(validate({**spec, "output": {"path": str(tmp_path / "whole")}})), progress=lambda m: None)
    assert whole.status == "complete"
    first = validate({**spec, "output": {"path": str(tmp_path / "out")}})
    with monkeypatch.context() as m:
        for key, value in hook_env(f"shard#2:raise:{tmp_path / 'fired'}").items():
            m.setenv(key, value)
        with pytest.raises(JobError, match="a worker failed"):
            run_job(Job.of(first), progress=lambda m: None)
    # as the previous version recorded it: a fingerprint that counted the settings as set
    record_path = tmp_path / "out" / "_job.json"
    record = json.loads(record_path.read_text())
    record["fingerprint"] = fingerprint(first, tuned=False, planned=False)
    record_path.write_text(json.dumps(record))
    # the engine's tuning settings and the shard settings changed: the output keeps its shards of 2 rows
    tuned = validate({**spec, "output": {"path": str(tmp_path / "out")}, "engine": TUNED,
                      "workers": {"rows_per_batch": 3, "shard_bytes": 64}})
    said = []
    result = run_job(Job.of(tuned), progress=said.append)
    assert result.status == "complete" and 0 < result.rows_this_run < 8
    assert len(list((tmp_path / "out" / "data").iterdir())) == 4  # 8 rows in shards of 2, as it started
    assert any("keeps the shards it started with (workers.rows_per_batch 2" in line for line in said), said
    out, want = read_output(tmp_path / "out").to_pylist(), read_output(tmp_path / "whole").to_pylist()
    assert Counter(r["id"] for r in out) == Counter(f"in.jsonl:{i}" for i in range(8))
    by_id = {r["id"]: r["generated_text"] for r in want}
    assert {r["id"]: r["generated_text"] for r in out} == by_id
    assert json.loads(record_path.read_text())["fingerprint"] == tuned.fingerprint()
