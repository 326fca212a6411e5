"""The bad-input corpus: each case is a per-row error or a one-line fatal cause; none may hang,
crash an actor or lose the other rows."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from helpers import read_output, write_jsonl
from jobs.cli import main

pytestmark = [pytest.mark.usefixtures("ray_local"), pytest.mark.timeout(180)]


def run(*args):
    result = CliRunner().invoke(main, ["run", *map(str, args)], catch_exceptions=False)
    return result.exit_code, result.output


CORPUS = [
    (b'{"prompt": "good one"}', None),
    (b'{"prompt": "unterminated', "malformed JSON"),
    (b'{"prompt": "bad utf-8 \xff\xfe here"}', "malformed JSON"),
    (b'[1, 2, 3]', "expected a JSON object"),
    (b'{"prompt": null}', "prompt is null"),
    (b'{"prompt": ""}', "prompt is empty"),
    (b'{"prompt": 42}', "prompt must be text, got int"),
    (b'{"prompt": ["a", "list"]}', "prompt must be text, got list"),
    (b'{"prompt": {"a": "dict"}}', "prompt must be text, got dict"),
    (b'{"text": "no prompt column in this row"}', "row has no column 'prompt'"),
    (b'{"prompt": "' + b"long " * 300 + b'"}', "exceeds max_model_len (512)"),
    (b'{"prompt": "another good one"}', None),
]


def corpus_file(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\n".join(line for line, _ in CORPUS) + b"\n")
    return path


def test_every_bad_row_is_an_output_row_with_its_cause(tmp_path):
    inp = corpus_file(tmp_path / "in" / "corpus.jsonl")
    code, text = run("--model", "builtin:echo", "--input", inp, "--output", tmp_path / "out", "--set", "engine.max_model_len=512",
                     "--set", "sampling.max_tokens=4", "--set", "max_error_rate=1", "--set", "workers.num=2",
                     "--set", "workers.rows_per_batch=3")
    assert code == 0, text
    rows = {r["id"]: r for r in read_output(tmp_path / "out").to_pylist()}
    assert len(rows) == len(CORPUS)
    for i, (_, cause) in enumerate(CORPUS):
        row = rows[f"corpus.jsonl:{i}"]
        if cause is None:
            assert row["finish_reason"] in ("stop", "length") and row["error"] is None
        else:
            assert row["finish_reason"] == "error" and cause in row["error"], (i, row["error"])
    assert "corpus.jsonl line 2: malformed JSON" in rows["corpus.jsonl:1"]["error"]


def test_on_bad_line_skip_and_fail(tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    inp.write_text(inp.read_text() + "{broken\n" + json.dumps({"prompt": "c"}) + "\n")
    code, text = run("--model", "builtin:echo", "--input", inp, "--output", tmp_path / "skip", "--set", "input.on_bad_line=skip",
                     "--set", "sampling.max_tokens=2")
    assert code == 0, text
    assert sorted(read_output(tmp_path / "skip")["id"].to_pylist()) == ["in.jsonl:0", "in.jsonl:1", "in.jsonl:3"]
    assert json.loads((tmp_path / "skip" / "manifest.json").read_text())["skipped"] == 1
    code, text = run("--model", "builtin:echo", "--input", inp, "--output", tmp_path / "fail", "--set", "input.on_bad_line=fail",
                     "--set", "sampling.max_tokens=2")
    assert code == 1 and "error: in.jsonl line 3: malformed JSON" in text


def test_empty_files_and_an_empty_dataset(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "empty.jsonl").write_text("")
    (tmp_path / "in" / "blank.jsonl").write_text("\n\n")
    code, text = run("--model", "builtin:echo", "--input", tmp_path / "in", "--output", tmp_path / "out")
    assert code == 0, text
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["rows"] == 0 and (tmp_path / "out" / "_SUCCESS").exists()
    write_jsonl(tmp_path / "in" / "real.jsonl", [{"prompt": "x"}])
    code, text = run("--model", "builtin:echo", "--input", tmp_path / "in", "--output", tmp_path / "out2", "--set", "sampling.max_tokens=2")
    assert code == 0 and json.loads((tmp_path / "out2" / "manifest.json").read_text())["rows"] == 1


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_a_lone_surrogate_in_any_input_value_is_written_as_u_fffd(tmp_path, fmt):
    # JSON's \ud800 escape decodes to a lone surrogate, which UTF-8 (Parquet, JSONL) cannot hold
    inp = tmp_path / "in" / "surrogates.jsonl"
    inp.parent.mkdir(parents=True)
    inp.write_bytes(b'{"id": "a\\ud800", "prompt": "one \\udc00 two", "tag": {"k\\udfff": ["\\ud83d\\ude00"]}}\n'
                    b'{"id": "b", "prompt": "plain"}\n')
    args = ["--model", "builtin:echo", "--input", inp, "--output", tmp_path / "out", "--set", "input.id_column=id",
            "--set", "sampling.max_tokens=4", "--set", f"output.format={fmt}"]
    code, text = run(*args)
    assert code == 0, text
    rows = {r["id"]: r for r in read_output(tmp_path / "out").to_pylist()}
    assert sorted(rows) == ["a\ufffd", "b"]
    assert rows["a\ufffd"]["prompt"] == "one \ufffd two" and rows["a\ufffd"]["error"] is None
    tag = rows["a\ufffd"]["tag"]
    assert (json.loads(tag) if isinstance(tag, str) else tag) == {"k\ufffd": ["\U0001f600"]}  # a pair is one character
    code, text = run(*args)  # resumes: already complete, every id once
    assert code == 0, text
    assert sorted(r["id"] for r in read_output(tmp_path / "out").to_pylist()) == ["a\ufffd", "b"]
