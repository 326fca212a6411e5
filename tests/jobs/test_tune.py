"""`batchinfer tune`: a table per setting of the job's own sample, a recommendation under a memory
limit, a PNG on request."""
from __future__ import annotations

import sys

import pytest
from click.testing import CliRunner

from engine import EngineConfig
from helpers import write_jsonl
from jobs import tune as T
from jobs.cli import main

pytestmark = pytest.mark.timeout(300)


def spec_file(tmp_path, extra: str = "") -> str:
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"tell me about number {i}" + "!" * (5 * (i % 5))} for i in range(12)])
    path = tmp_path / "job.yaml"
    path.write_text(f"model: builtin:tiny\ninput: {{path: {tmp_path / 'in.jsonl'}}}\noutput: {{path: {tmp_path / 'out'}}}\n"
                    f"sampling: {{max_tokens: 6, temperature: 0}}\n{extra}")
    return str(path)


def invoke(*args):
    result = CliRunner().invoke(main, ["tune", *map(str, args)], catch_exceptions=False)
    return result.exit_code, result.stdout, result.output


def test_tune_measures_each_setting_and_recommends_one_under_the_limit(tmp_path):
    code, out, text = invoke(spec_file(tmp_path), "--rows", 8, "--max-batch-tokens", "40,1024", "--max-num-seqs", 4,
                             "--memory-limit", "64GiB", "--plot", tmp_path / "tune.png")
    assert code == 0, text
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["max_batch_tokens", "max_num_seqs", "scheduling"]
    rows = [line[2:].split() for line in lines[1:5]]
    assert [(r[0], r[1], r[2]) for r in rows] == [("40", "4", "static"), ("40", "4", "continuous"),
                                                  ("1024", "4", "static"), ("1024", "4", "continuous")]
    errors = {r[0]: int(r[-1]) for r in rows}
    assert errors["1024"] == 0 and errors["40"] > 0  # prompt + max_tokens above a 40-token budget
    assert [line[0] for line in lines[1:5]].count("*") == 1 and lines[1][0] == lines[2][0] == " "  # no errors
    assert "recommended under 65536 MiB: --set engine.max_batch_tokens=1024 --set engine.max_num_seqs=4" in out
    assert "[4/4]" in text and (tmp_path / "tune.png").stat().st_size > 1000


def test_no_setting_fits_a_tiny_memory_limit(tmp_path):
    code, out, text = invoke(spec_file(tmp_path), "--rows", 4, "--max-batch-tokens", 512, "--max-num-seqs", 2,
                             "--scheduling", "static", "--memory-limit", "1MiB")
    assert code == 0, text
    assert "no setting fits under 1 MiB: the smallest peak was" in out


def test_label_task_is_tuned_on_choice_scoring(tmp_path):
    spec = spec_file(tmp_path, "task: label\nlabel: {choices: [good, bad]}\n")
    code, out, text = invoke(spec, "--rows", 4, "--max-batch-tokens", 512, "--max-num-seqs", 4, "--scheduling", "static")
    assert code == 0, text
    row = out.splitlines()[1][2:].split()
    assert row[:3] == ["512", "4", "static"] and row[4] == "0.0" and row[6] == "-"  # no tokens generated, no TTFT
    assert "recommended: --set engine.max_batch_tokens=512" in out and " tok/s" in out


def test_plot_without_matplotlib_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, out, text = invoke(spec_file(tmp_path), "--rows", 2, "--max-batch-tokens", 512, "--max-num-seqs", 2,
                             "--scheduling", "static", "--plot")
    assert code == 1 and "error: --plot needs matplotlib" in text


def test_bad_options_are_usage_errors(tmp_path):
    spec = spec_file(tmp_path)
    assert invoke(spec, "--memory-limit", "lots")[0] == 2
    code, _, text = invoke(spec, "--scheduling", "static,eager")
    assert code == 2 and "scheduling must be among static, continuous" in text


def test_memory_sizes_and_kv_bytes():
    assert T.parse_bytes("8GiB") == 8 * 2**30 and T.parse_bytes("16G") == 16 * 10**9
    assert T.parse_bytes("512MiB") == 512 * 2**20 and T.parse_bytes("2e9") == 2 * 10**9
    # builtin:tiny: 4 layers x 2 KV heads x head dim 32, keys and values, float32 on CPU
    from engine import LLMEngine

    memory = LLMEngine(EngineConfig(model="builtin:tiny", device="cpu")).memory
    assert memory["kv_bytes"] // memory["kv_tokens"] == 4 * 2 * 32 * 2 * 4
    assert memory["kv_blocks"] * memory["block_size"] == memory["kv_tokens"] == 8192


def test_recommendation_is_the_smallest_setting_near_the_fastest_that_fits():
    def m(mbt, mns, tokens, kv, memory, errors=0):
        return T.Measurement(T.Setting(mbt, mns, "static"), seconds=1.0, rows=10, errors=errors, prompt_tokens=0,
                             generated_tokens=tokens, peak_kv_tokens=kv, kv_bytes_per_token=1,
                             peak_memory_bytes=memory)

    small, big, bigger = m(1024, 8, 980, 500, 100), m(4096, 32, 1000, 2000, 200), m(8192, 64, 1500, 4000, 400)
    broken = m(512, 8, 2000, 100, 50, errors=3)
    assert T.recommend([small, big, broken], None) is small  # 2% slower for a quarter of the KV memory
    assert T.recommend([small, big, bigger, broken], None) is bigger
    assert T.recommend([small, big, bigger], memory_limit=300) is small
    assert T.recommend([big, bigger], memory_limit=150) is None


def test_the_memory_lines_name_the_quantization_and_the_load_peak():
    from jobs.tune_report import pools

    memory = {"kv_blocks": 64, "block_size": 16, "kv_bytes": 8 * 2**20, "weights_bytes": 100 * 2**20,
              "unquantized_weights_bytes": 200 * 2**20, "quantization": "int8", "load_peak_bytes": 120 * 2**20,
              "streamed": True}
    run = T.Measurement(T.Setting(1024, 8, "static"), seconds=1.0, rows=1, errors=0, prompt_tokens=0,
                        generated_tokens=1, peak_kv_tokens=1, kv_bytes_per_token=1, peak_memory_bytes=1,
                        memory=memory)
    lines = pools([run]).splitlines()
    assert lines[1] == "  weights: 100.0 MiB with quantization int8, 200.0 MiB without: it saves 100.0 MiB (0.50x)"
    assert lines[2] == "  loading them added 120.0 MiB at its peak (each layer quantized as it was read)"
    plain = pools([T.Measurement(**{**run.__dict__, "memory": {**memory, "quantization": None, "streamed": False}})])
    assert plain.splitlines()[2] == "  loading them added 120.0 MiB at its peak"
