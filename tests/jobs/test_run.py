"""End-to-end jobs through the CLI on a local Ray: inputs in, every id out exactly once."""
from __future__ import annotations

import json
import re
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from helpers import committed_ids, read_output, write_jsonl
from engine import EngineConfig, LLMEngine
from jobs.cli import main
from pipeline.index import part_entries

pytestmark = pytest.mark.usefixtures("ray_local")


def run(*args):
    result = CliRunner().invoke(main, ["run", *map(str, args)], catch_exceptions=False)
    return result.exit_code, result.output


def test_jsonl_directory_with_two_actors_then_rerun_is_a_noop(tmp_path):
    for f in range(3):
        rows = [{"prompt": f"file {f} row {i}", "n": i, "meta": {"f": f}} for i in range(25)]
        write_jsonl(tmp_path / "in" / f"part{f}.jsonl", rows)
    out = tmp_path / "out"
    code, text = run("--model", "builtin:echo", "--input", tmp_path / "in", "--output", out, "--set", "workers.num=2",
                     "--set", "workers.rows_per_batch=10", "--set", "sampling.max_tokens=6")
    assert code == 0, text
    table = read_output(out)
    ids = table["id"].to_pylist()
    assert sorted(ids) == sorted(f"part{f}.jsonl:{i}" for f in range(3) for i in range(25))
    assert len(ids) == len(set(ids)) == 75
    assert set(table.column_names) >= {"prompt", "n", "meta", "generated_text", "num_prompt_tokens",
                                       "num_generated_tokens", "finish_reason", "error"}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["rows"] == 75 and manifest["errors"] == 0
    assert manifest["generated_tokens"] == sum(table["num_generated_tokens"].to_pylist())
    assert manifest["status"] == "complete" and (out / "_SUCCESS").exists()
    assert manifest["index"]["parts"] == 9 and len(list(part_entries(str(out)))) == 9
    assert "parts" not in manifest and len(manifest["workers"]) >= 1
    assert "rows" in text and "75" in text  # summary table

    before = {p.name: p.stat().st_mtime_ns for p in (out / "data").iterdir()}
    code, text = run("--model", "builtin:echo", "--input", tmp_path / "in", "--output", out, "--set", "workers.num=2",
                     "--set", "workers.rows_per_batch=10", "--set", "sampling.max_tokens=6")
    assert code == 0 and "nothing to do" in text
    assert {p.name: p.stat().st_mtime_ns for p in (out / "data").iterdir()} == before


def test_parquet_template_id_column_and_jsonl_output(tmp_path):
    (tmp_path / "in").mkdir()
    for f in range(2):
        table = pa.table({"qid": [f"q{f}-{i}" for i in range(12)], "question": [f"what is {i}?" for i in range(12)],
                          "answer": [str(i) for i in range(12)]})
        pq.write_table(table, tmp_path / "in" / f"{f}.parquet", row_group_size=5)
    spec = tmp_path / "job.yaml"
    spec.write_text(f"""
model: builtin:echo
input: {{path: {tmp_path / 'in'}, template: "Q: {{question}}\\nA:", id_column: qid, columns: [answer]}}
output: {{path: {tmp_path / 'out'}, format: jsonl}}
sampling: {{max_tokens: 4, temperature: 0.0}}
workers: {{rows_per_batch: 7}}
""")
    code, text = run(spec)
    assert code == 0, text
    assert text.count("checking that id_column values are unique, beside the work") == 1, text
    assert json.loads((tmp_path / "out" / "_job.json").read_text())["ids_unique"] is True
    table = read_output(tmp_path / "out")
    assert sorted(table["id"].to_pylist()) == sorted(f"q{f}-{i}" for f in range(2) for i in range(12))
    # a resume of an output whose ids were checked does not check them again
    for name in ("_SUCCESS", "manifest.json"):
        (tmp_path / "out" / name).unlink()
    sorted((tmp_path / "out" / "data").glob("part-*"))[0].unlink()
    code, resumed = run(spec)
    assert code == 0 and "checking that id_column" not in resumed, resumed
    assert sorted(read_output(tmp_path / "out")["id"].to_pylist()) == sorted(table["id"].to_pylist())
    assert "question" not in table.column_names and "answer" in table.column_names
    for row in table.to_pylist():  # builtin:echo's byte tokenizer: BOS + one token per byte of the rendered template
        question = f"what is {row['id'].split('-')[1]}?"
        assert row["num_prompt_tokens"] == 1 + len(f"Q: {question}\nA:".encode()), row


def test_bad_rows_are_outputs_and_the_error_rate_sets_the_exit_code(tmp_path):
    rows = [{"prompt": "fine"}, {"prompt": None}, {"prompt": ""}, {"prompt": 7}, {"prompt": "x" * 5000}]
    write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    code, text = run("--model", "builtin:echo", "--input", tmp_path / "in.jsonl", "--output", out, "--set", "sampling.max_tokens=4",
                     "--set", "engine.max_model_len=1024")
    assert code == 3, text
    assert "4 of 5 rows failed" in text and "prompt is null" in text
    assert not (out / "_SUCCESS").exists()
    table = read_output(out)
    by_id = {r["id"]: r for r in table.to_pylist()}
    assert by_id["in.jsonl:0"]["finish_reason"] in ("stop", "length")
    assert by_id["in.jsonl:1"]["error"] == "prompt is null"
    assert by_id["in.jsonl:2"]["error"] == "prompt is empty"
    assert by_id["in.jsonl:3"]["error"] == "prompt must be text, got int"
    assert "max_model_len (1024)" in by_id["in.jsonl:4"]["error"]
    # Accepting the errors: the same output completes without generating anything again.
    code, text = run("--model", "builtin:echo", "--input", tmp_path / "in.jsonl", "--output", out, "--set", "sampling.max_tokens=4",
                     "--set", "engine.max_model_len=1024", "--set", "max_error_rate=0.9")
    assert code == 0 and (out / "_SUCCESS").exists() and "(0 this run)" in text


@pytest.mark.parametrize("case", ["no_files", "missing_column", "missing_model", "bad_template"])
def test_fatal_problems_fail_fast_with_one_line(tmp_path, case):
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"text": "hi"}])
    args = ["--model", "builtin:tiny", "--input", tmp_path / "in", "--output", tmp_path / "out", "--set", "input.prompt_column=text"]
    expected = {"no_files": "no input files", "missing_column": "input column 'prompt' not found in a.jsonl",
                "missing_model": "model directory not found", "bad_template": "not allowed"}[case]
    if case == "no_files":
        args[3] = tmp_path / "empty"
        (tmp_path / "empty").mkdir()
    elif case == "missing_column":
        args[-1] = "input.prompt_column=prompt"
    elif case == "missing_model":
        args += ["--model", tmp_path / "no-such-model"]
    else:
        args += ["--set", "input.template='{text.__class__}'"]
    start = time.time()
    code, text = run(*args)
    assert code == 1 and expected in text, text
    assert len([ln for ln in text.splitlines() if ln.startswith("error:")]) == 1
    assert time.time() - start < 20


def test_a_different_spec_on_the_same_output_is_refused(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    base = ["--model", "builtin:echo", "--input", tmp_path / "in.jsonl", "--output", tmp_path / "out", "--set", "sampling.max_tokens=3"]
    assert run(*base)[0] == 0
    code, text = run(*base[:-1], "sampling.max_tokens=5")
    assert code == 1 and "different job spec" in text and "--overwrite" in text
    code, text = run(*base[:-1], "sampling.max_tokens=5", "--overwrite")
    assert code == 0
    assert sorted(committed_ids(tmp_path / "out")) == ["in.jsonl:0", "in.jsonl:1"]
    # the new job's record: its own spec as set (no value hidden for a name holding "token"), and
    # its own usage (the replaced job's run records went with it)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["spec"]["sampling"]["max_tokens"] == 5 and manifest["usage"]["runs"] == 1
    assert json.loads((tmp_path / "out" / "_job.json").read_text())["spec"]["sampling"]["max_tokens"] == 5


def test_a_duplicate_id_stops_the_job_naming_both_places_and_a_rerun_refuses_until_trusted(tmp_path):
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"id": f"r{i}", "prompt": f"x{i}"} for i in range(60)])
    write_jsonl(tmp_path / "in" / "b.jsonl", [{"id": f"s{i}", "prompt": f"y{i}"} for i in range(3)]
                + [{"id": "r1", "prompt": "again"}])
    out = tmp_path / "out"
    args = ["--model", "builtin:echo", "--input", tmp_path / "in", "--output", out, "--set", "input.id_column=id",
            "--set", "sampling.max_tokens=2", "--set", "workers.rows_per_batch=2"]
    code, text = run(*args)
    line = "duplicate id 'r1' in column 'id': a.jsonl row 1 and b.jsonl row 3 (ids must be unique)"
    assert code == 1 and f"{line}; the job stopped: the " in text, text
    assert not (out / "_SUCCESS").exists() and not (out / "manifest.json").exists()
    kept = int(re.search(r"the (\d+) parts committed before are kept", text).group(1))
    # found while the engine loads, the duplicate stops the job after a few of its 32 shards
    assert kept == len(list((out / "data").glob("part-*"))) < 32
    assert json.loads((out / "_job.json").read_text())["ids_duplicate"]["line"] == line
    code, again = run(*args)  # the same input: refused in the same line, before any shard
    assert code == 1 and f"{line}; fix the input and rerun" in again and "rows" not in again, again
    assert len(list((out / "data").glob("part-*"))) == kept
    code, trusted = run(*args, "--set", "input.unique_ids=trust")  # vouched for: not checked, not fingerprinted
    assert code == 0, trusted
    assert trusted.count("input.unique_ids is trust: ids are not checked") == 1, trusted
    ids = read_output(out)["id"].to_pylist()
    assert len(ids) == 64 and ids.count("r1") == 2  # what trusting a duplicate costs: two rows for one id


def test_s3_input_to_s3_output(tmp_path, s3_server):
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server})
    fs.mkdir("batchinfer-test")
    for f in range(2):
        fs.pipe(f"batchinfer-test/in/{f}.jsonl",
                "".join(json.dumps({"prompt": f"s3 {f} {i}"}) + "\n" for i in range(8)).encode())
    code, text = run("--model", "builtin:echo", "--input", "s3://batchinfer-test/in/", "--output", "s3://batchinfer-test/out/",
                     "--set", "workers.rows_per_batch=5", "--set", "sampling.max_tokens=3")
    assert code == 0, text
    assert fs.exists("batchinfer-test/out/_SUCCESS")
    manifest = json.loads(fs.cat("batchinfer-test/out/manifest.json"))
    parts = list(part_entries("s3://batchinfer-test/out/"))
    assert manifest["rows"] == 16 and parts and all(p["path"].startswith("s3://") for p in parts)
    ids = []
    for part in parts:
        with fs.open(part["path"]) as f:
            ids += pq.read_table(f)["id"].to_pylist()
    assert sorted(ids) == sorted(f"{f}.jsonl:{i}" for f in range(2) for i in range(8))
    assert "testing-secret" not in json.dumps(manifest)


def test_validate_counts_rows_without_generating(tmp_path):
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"prompt": str(i)} for i in range(7)])
    write_jsonl(tmp_path / "in" / "b.jsonl", [{"prompt": str(i)} for i in range(5)])
    result = CliRunner().invoke(main, ["validate", "--model", "builtin:tiny", "--input", str(tmp_path / "in"), "--output",
                                       str(tmp_path / "out"), "--set", "workers.rows_per_batch=4"])
    assert result.exit_code == 0, result.output
    assert "ok: 2 files, 12 rows" in result.output and "4 shards" in result.output
    assert not (tmp_path / "out").exists()


def test_validate_makes_the_checks_of_run(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    result = CliRunner().invoke(main, ["validate", "--model", "builtin:tiny", "--input", str(tmp_path / "in.jsonl"),
                                       "--output", str(tmp_path / "out")])
    assert result.exit_code == 1 and "input column 'prompt' not found in in.jsonl" in result.output, result.output


def test_validate_refuses_a_tensor_parallel_size_the_models_heads_cannot_split(tmp_path):
    # SmolLM2-135M: 9 query heads, 3 KV heads; the run failed in every worker's setup before
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}])
    result = CliRunner().invoke(main, ["validate", "--model", "builtin:smollm2-135m-instruct", "--input",
                                       str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out"), "--set",
                                       "engine.tensor_parallel_size=2"])
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 1 and len(errors) == 1, result.output
    assert "tensor_parallel_size 2 does not divide the model's num_attention_heads 9, num_key_value_heads 3" \
        in errors[0], errors


def test_unwritable_output_is_fatal(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}])
    (tmp_path / "file").write_text("not a directory")
    code, text = run("--model", "builtin:tiny", "--input", tmp_path / "in.jsonl", "--output", tmp_path / "file" / "out")
    assert code == 1 and "cannot write to output" in text, text


def test_cost_and_throughput_report(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"cost {i}"} for i in range(12)])
    out = tmp_path / "out"
    code, text = run("--model", "builtin:tiny", "--input", tmp_path / "in.jsonl", "--output", out, "--set", "sampling.max_tokens=5",
                     "--set", "report.price_per_hour=3.5", "--set", "workers.rows_per_batch=5")
    assert code == 0, text
    usage = json.loads((out / "manifest.json").read_text())["usage"]
    assert usage["runs"] == 1 and usage["cpu_core_hours"] > 0 and usage["tokens_per_second"] > 0
    assert usage["cost"] == pytest.approx(3.5 * usage["cpu_core_hours"])
    assert usage["cost_per_1m_generated_tokens"] == pytest.approx(usage["cost"] / 60 * 1e6)
    shown = CliRunner().invoke(main, ["report", str(out)])
    assert shown.exit_code == 0 and "cost per 1M generated tokens" in shown.output
    assert re.search(r"status\s+complete", shown.output) and re.search(r"shards committed\s+3 of 3", shown.output)
    data = json.loads(CliRunner().invoke(main, ["report", str(out), "--json"]).output)
    assert data["rows"] == 12 and data["generated_tokens"] == 60 and len(data["workers"]) == 1
    assert "devices: the Ray cluster has no GPUs: each engine actor runs its one rank on CPU" in text
    # the engine that generated the parts, as resolved: the same figures an engine of this spec reports
    (engine,) = json.loads((out / "manifest.json").read_text())["engines"]
    spec = json.loads((out / "manifest.json").read_text())["spec"]
    want = LLMEngine(EngineConfig(model=spec["model"], **{k: spec["engine"][k] for k in ("max_batch_tokens",
                                                                                         "max_num_seqs")}))
    memory = want.memory
    report_engine = dict(engine)
    paths = engine.pop("fast_paths", {})  # the C++ attention kernel's check, where the actor loaded it
    assert all(state == "checked" for state in paths.values()) and set(paths) <= {"cpu_attention"}, paths
    assert engine == {"device": "cpu", "dtype": "float32", "quantization": None, "tensor_parallel_size": 1,
                      "weights_bytes": memory["weights_bytes"], "kv_blocks": memory["kv_blocks"],
                      "block_size": memory["block_size"], "kv_bytes": memory["kv_bytes"], "kv_cache_dtype": "auto",
                      "max_num_batched_tokens": want.max_num_batched_tokens, "shards": 3, "rows": 12,
                      "load_peak_bytes": engine["load_peak_bytes"]}
    assert 0 < engine["load_peak_bytes"] < 4 * memory["weights_bytes"]  # the actor's load, as it measured it
    assert engine["weights_bytes"] > 0 and engine["kv_bytes"] > 0 and data["engines"] == [report_engine]
    assert re.search(r"cpu float32\s+-\s+[0-9.]+ MiB\s+\d+\s+[0-9.]+ MiB\s+\d+\s+3", shown.output), shown.output
    missing = CliRunner().invoke(main, ["report", str(tmp_path / "nothing")])
    assert missing.exit_code == 1 and "no batchinfer job" in missing.output


def test_a_live_run_lock_blocks_a_second_run_and_a_stale_one_is_taken_over(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": "locked"}])
    out = tmp_path / "out"
    out.mkdir()
    lock = {"owner": "scheduler-2:4242:abcd", "host": "scheduler-2", "pid": 4242, "heartbeat": time.time()}
    (out / "_lock.json").write_text(json.dumps(lock))
    args = ["--model", "builtin:echo", "--input", tmp_path / "in.jsonl", "--output", out, "--set", "sampling.max_tokens=2",
            "--set", "output.lock_stale_after_s=60"]
    code, text = run(*args)
    assert code == 1 and "another run (scheduler-2:4242:abcd" in text
    assert not (out / "data").exists()
    (out / "_lock.json").write_text(json.dumps(lock | {"heartbeat": time.time() - 120}))
    code, text = run(*args)
    assert code == 0 and "took over the stale lock of scheduler-2:4242:abcd" in text
    assert not (out / "_lock.json").exists()


# two builtin:tiny jobs (~28 s); fast sibling: test_requests' seeded sampling that ignores the mode
@pytest.mark.slow
def test_scheduling_modes_write_the_same_rows(tmp_path):
    """engine.scheduling selects the batching mode; seeded sampling (a seed per row id) makes
    both modes write identical outputs."""
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"row {i} " + "x" * (i % 7)} for i in range(20)])
    texts = {}
    for mode in ("static", "continuous"):
        code, text = run("--model", "builtin:tiny", "--input", tmp_path / "in.jsonl", "--output", tmp_path / mode,
                         "--set", f"engine.scheduling={mode}", "--set", "engine.max_batch_tokens=300",
                         "--set", "sampling.max_tokens=12", "--set", "sampling.temperature=0.8")
        assert code == 0, text
        rows = read_output(tmp_path / mode).to_pylist()
        texts[mode] = {r["id"]: (r["generated_text"], r["num_generated_tokens"]) for r in rows}
        manifest = json.loads((tmp_path / mode / "manifest.json").read_text())
        assert manifest["spec"]["engine"]["scheduling"] == mode
    assert texts["static"] == texts["continuous"] and len(texts["static"]) == 20


@pytest.mark.parametrize("setting,named", [("workers.gpus=1", "workers.gpus=1: no node of the Ray cluster has 1 GPU"),
                                           ("workers.cpus=64", "workers.cpus=64: no node")])
def test_actors_that_cannot_fit_the_cluster_fail_at_once_in_one_line(tmp_path, setting, named):
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}])
    start = time.time()
    code, text = run("--model", "builtin:tiny", "--input", tmp_path / "in.jsonl", "--output", tmp_path / "out", "--set", setting)
    errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert code == 1 and len(errors) == 1 and named in errors[0], text
    assert time.time() - start < 30
    assert not (tmp_path / "out" / "_lock.json").exists() and not (tmp_path / "out" / "data").exists()


def test_a_shared_instruction_prefix_is_computed_once_and_reported(tmp_path):
    """Rows that repeat the same instructions hit the engine's prefix cache: the manifest, the
    summary table and `batchinfer report` say how much of the prompt was reused."""
    instructions = "Classify the sentiment of the following product review as positive or negative. " * 2
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"{instructions}Review {i}: it was fine."} for i in range(12)])
    out = tmp_path / "out"
    code, text = run("--model", "builtin:tiny", "--input", tmp_path / "in.jsonl", "--output", out, "--set", "sampling.max_tokens=2")
    assert code == 0, text
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["cached_prompt_tokens"] > 0 and 0.5 < manifest["prefix_cache_hit_rate"] < 1
    assert re.search(r"prefix cache hits\s+\d+\.\d% of prompt tokens", text)
    report = CliRunner().invoke(main, ["report", str(out)]).output
    assert f"{manifest['prefix_cache_hit_rate']:.1%} of prompt tokens" in report
