"""LoRA in jobs: lora.each runs every row under every adapter (and the base model) with exactly
one row per (id, adapter) after a crash and a resume; an adapter added later computes only its
own rows; per-adapter metrics equal single-adapter jobs'; lora.column routes rows; a bad adapter
is fatal at preflight when the spec names it."""
from __future__ import annotations

import json
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from chaos.harness import hook_env  # noqa: E402
from helpers import read_output, write_jsonl  # noqa: E402
from lora_models import edit_config, make_adapter  # noqa: E402
from pipeline import build_processor  # noqa: E402
from pipeline.errors import JobError, OutputConflict  # noqa: E402
from pipeline.run import run_job  # noqa: E402
from pipeline.spec import Job, validate  # noqa: E402
from tiny_models import build_tiny_model  # noqa: E402

pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("ray_local")  # the session's one local Ray (run_job would start its own)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_jobs")
    base = build_tiny_model("llama", root / "llama")
    folder = root / "adapters"
    for k, (r, targets) in enumerate([(8, ["q_proj", "v_proj"]), (16, ["o_proj", "down_proj"]), (4, ["up_proj"])]):
        make_adapter(base, folder / f"ft{k}", r, targets, seed=k + 1)
    return base, folder


ROWS = [{"prompt": f"q{i} " + "ab" * (i % 4), "answer": "ab"} for i in range(8)]


def spec_for(base: Path, inp: Path, out: Path, **lora) -> dict:
    return {"task": "eval", "model": str(base), "input": {"path": str(inp)}, "output": {"path": str(out)},
            "sampling": {"max_tokens": 4, "temperature": 0}, "eval": {"reference_column": "answer",
                                                                      "metrics": ["contains"]},
            "workers": {"rows_per_batch": 3, "num": 1}, "lora": lora}


@pytest.mark.slow
def test_each_adapter_and_the_base_resume_exactly_once_and_an_added_adapter_computes_only_its_rows(
        family, tmp_path, monkeypatch):
    base, folder = family
    write_jsonl(tmp_path / "in.jsonl", ROWS)
    two = tmp_path / "two"
    two.mkdir()
    for name in ("ft0", "ft1"):
        shutil.copytree(folder / name, two / name)
    spec = spec_for(base, tmp_path / "in.jsonl", tmp_path / "out", path=str(two), each=True, include_base=True)
    for key, value in hook_env(f"shard#2:raise:{tmp_path / 'fired'}").items():
        monkeypatch.setenv(key, value)
    with pytest.raises(JobError, match="a worker failed"):
        run_job(Job.of(validate(spec)), progress=lambda msg: None)
    result = run_job(Job.of(validate(spec)), progress=lambda msg: None)
    assert result.status == "complete" and result.rows == 24 and 0 < result.rows_this_run < 24
    out = read_output(tmp_path / "out")
    assert Counter(zip(out["id"].to_pylist(), out["adapter"].to_pylist())) == Counter(
        (f"in.jsonl:{i}", a) for i in range(8) for a in (None, "ft0", "ft1"))
    by = {(r["id"], r["adapter"]): r["generated_text"] for r in out.to_pylist()}
    assert any(by[(i, "ft0")] != by[(i, None)] for i, _ in by)  # the adapter changes what is generated
    # per-adapter metrics equal those of a job with that adapter alone (or the base model alone)
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    for name in ("ft0", "ft1", None):
        lora = {"adapters": {name: str(folder / name)}, "each": True} if name else {}
        single = spec_for(base, tmp_path / "in.jsonl", tmp_path / f"single-{name}", **lora)
        run_job(Job.of(validate(single)), progress=lambda msg: None)
        alone = json.loads((tmp_path / f"single-{name}" / "metrics.json").read_text())
        assert metrics["adapters"][name or "null"]["metrics"] == alone["metrics"]
    # a third adapter added: only its 8 rows run, the 24 committed stay
    spec["lora"] = {"path": str(two), "adapters": {"ft2": str(folder / "ft2")}, "each": True, "include_base": True}
    again = run_job(Job.of(validate(spec)), progress=lambda msg: None)
    assert again.status == "complete" and again.rows == 32 and again.rows_this_run == 8
    # an adapter whose files changed is refused on resume
    edit_config(two / "ft0", lora_alpha=99)
    with pytest.raises(OutputConflict, match="adapter ft0's files changed"):
        run_job(Job.of(validate(spec)), progress=lambda msg: None)


def test_each_gives_one_row_per_id_and_adapter_with_metrics_per_adapter(family, tmp_path):
    base, folder = family
    write_jsonl(tmp_path / "in.jsonl", ROWS[:4])
    spec = spec_for(base, tmp_path / "in.jsonl", tmp_path / "out", adapters={"ft1": str(folder / "ft1")}, each=True,
                    include_base=True)
    result = run_job(Job.of(validate(spec)), progress=lambda msg: None)
    out = read_output(tmp_path / "out")
    assert result.rows == 8 and sorted(Counter(out["adapter"].to_pylist()).items(), key=str) == [("ft1", 4), (None, 4)]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert {k: v["rows"] for k, v in metrics["adapters"].items()} == {"ft1": 4, "null": 4}
    from click.testing import CliRunner

    from jobs.cli import main

    report = CliRunner().invoke(main, ["report", str(tmp_path / "out")])
    assert report.exit_code == 0, report.output
    table = report.output.split("adapter", 1)[1].splitlines()
    assert table[0].split() == ["rows", "contains"] and table[1].split()[0] == "(base" and table[2].split()[:2] == [
        "ft1", "4"]
    assert float(table[2].split()[2]) == metrics["adapters"]["ft1"]["metrics"]["contains"]["mean"]


def test_a_column_routes_rows_and_a_bad_adapter_is_fatal_at_preflight(family, tmp_path):
    base, folder = family
    rows = [{"prompt": f"q{i}", "answer": "x", "which": [None, "ft0", "ft1", "nope"][i % 4]} for i in range(8)]
    write_jsonl(tmp_path / "in.jsonl", rows)
    adapters = {"ft0": str(folder / "ft0"), "ft1": str(folder / "ft1")}
    spec = spec_for(base, tmp_path / "in.jsonl", tmp_path / "out", adapters=adapters, column="which")
    spec["max_error_rate"] = 0.5
    result = run_job(Job.of(validate(spec)), progress=lambda msg: None)
    assert result.rows == 8 and result.errors == 2
    got = {r["id"]: r for r in read_output(tmp_path / "out").to_pylist()}
    for i, row in enumerate(rows):
        r = got[f"in.jsonl:{i}"]
        if row["which"] == "nope":
            assert r["error"].startswith("unknown adapter 'nope'") and r["adapter"] is None
        else:
            assert r["error"] is None and r["adapter"] == row["which"]
    broken = tmp_path / "broken"
    shutil.copytree(folder / "ft0", broken)
    (broken / "adapter_model.safetensors").write_bytes(b"garbage")
    spec = spec_for(base, tmp_path / "in.jsonl", tmp_path / "out2", adapters={"bad": str(broken)}, column="which")
    with pytest.raises(JobError, match=r"lora.adapters.bad: adapter bad: adapter_model.safetensors is corrupt"):
        run_job(Job.of(validate(spec)), progress=lambda msg: None)


def test_build_processor_rows_name_their_adapter_by_model(family):
    import ray

    base, folder = family
    processor = build_processor({"model": str(base), "sampling": {"max_tokens": 4, "temperature": 0},
                                 "lora": {"path": str(folder)}})
    ds = ray.data.from_items([{"prompt": "hello", "model": m} for m in ("ft0", "ft2", str(base))])
    rows = processor(ds).take_all()
    # (Ray Data may hand rows back in another order: match them by their model)
    assert {r["model"]: r["adapter"] for r in rows} == {"ft0": "ft0", "ft2": "ft2", str(base): None}
    assert len(rows) == 3 and all(r["error"] is None for r in rows)


@pytest.mark.slow  # fast sibling: tests/engine/test_lora.py's OpenAI lines through TaskRunner
def test_openai_batch_lines_name_their_adapter_by_body_model(family, tmp_path):
    base, folder = family
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": m, "prompt": "hello", "max_tokens": 3, "temperature": 0}}
             for i, m in enumerate(["ft0", "gpt-4o-mini", "ft1"])]
    write_jsonl(tmp_path / "in.jsonl", lines)
    spec = {"model": str(base), "input": {"path": str(tmp_path / "in.jsonl"), "format": "openai_batch"},
            "output": {"path": str(tmp_path / "out"), "format": "jsonl"},
            "lora": {"adapters": {"ft0": str(folder / "ft0"), "ft1": str(folder / "ft1")}}}
    run_job(Job.of(validate(spec)), progress=lambda msg: None)
    got = {r["id"]: r for r in read_output(tmp_path / "out").to_pylist()}
    assert [got[f"r{i}"]["adapter"] for i in range(3)] == ["ft0", None, "ft1"]
    assert all(got[f"r{i}"]["error"] is None for i in range(3))
    assert got["r0"]["generated_text"] != got["r1"]["generated_text"] or got["r2"]["generated_text"] != got["r1"][
        "generated_text"]


def test_lora_each_with_an_id_column_counts_each_input_id_once(family, tmp_path):
    """lora.each plans each shard once per adapter; the unique-id check read every unit and found
    each id four times (`duplicate id 'r09'`), so any such job with input.id_column failed."""
    base, folder = family
    write_jsonl(tmp_path / "in.jsonl", [{**row, "id": f"r{i:02d}"} for i, row in
                                        enumerate(ROWS + ROWS[:4])])
    spec = spec_for(base, tmp_path / "in.jsonl", tmp_path / "out", path=str(folder), each=True, include_base=True)
    spec["input"]["id_column"] = "id"
    spec["workers"]["rows_per_batch"] = 12  # one shard of the 12 ids, once per adapter and the base
    result = run_job(Job.of(validate(spec)), progress=lambda msg: None)
    assert result.status == "complete" and result.rows == 48
    out = read_output(tmp_path / "out")
    assert Counter(zip(out["id"].to_pylist(), out["adapter"].to_pylist())) == Counter(
        (f"r{i:02d}", a) for i in range(12) for a in (None, "ft0", "ft1", "ft2"))
    duplicated = tmp_path / "dup.jsonl"
    write_jsonl(duplicated, [{**row, "id": "same" if i in (3, 7) else f"r{i}"} for i, row in enumerate(ROWS)])
    spec = spec_for(base, duplicated, tmp_path / "out2", path=str(folder), each=True, include_base=True)
    spec["input"]["id_column"] = "id"
    with pytest.raises(JobError, match="duplicate id 'same'"):
        run_job(Job.of(validate(spec)), progress=lambda msg: None)
