"""Structured outputs in a job: the spec's field (inline or from a file, relative to the spec),
its fingerprint, grammars compiled in preflight, label.json_schema's typed label_fields, OpenAI
Batch response_format, and incomplete rows that count as errors."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner

from engine import VIOLATION, EngineConfig, LLMEngine
from helpers import read_output, write_jsonl
from jobs.cli import main
from jobs.spec import load_spec
from pipeline.errors import JobError, SpecError
from pipeline.io import CommitRecord
from pipeline.run.checks.preflight import check_constraints
from pipeline.spec import INCOMPLETE, Row, validate
from pipeline.tasks import TaskRunner
from pipeline.tasks.label_fields import field_values, fields_type
from pipeline.tasks.openai_batch.requests import MAX_SCHEMA_BYTES, parse_request

BASE = {"input": {"path": "in.jsonl"}, "output": {"path": "out/"}}
REVIEW = {"type": "object", "properties": {"sentiment": {"enum": ["pos", "neg"]},
                                          "score": {"type": "integer", "minimum": 1, "maximum": 5},
                                          "ok": {"type": "boolean"}},
          "required": ["sentiment", "score"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny():
    return LLMEngine(EngineConfig(model="builtin:tiny"))


def spec(**sections):
    return validate({**BASE, **sections})


# -- the spec ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("sampling, message", [
    ({"structured_outputs": {}}, "sampling.structured_outputs: set exactly one of json, regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "(got regex, choice)"),
    ({"structured_outputs": {"choice": []}}, "sampling.structured_outputs: choice must be a list of non-empty"),
    ({"structured_outputs": {"jsonschema": {}}}, "sampling.structured_outputs.jsonschema: unknown key"),
])
def test_a_bad_structured_outputs_section_is_one_line_naming_the_key(sampling, message):
    with pytest.raises(SpecError, match="^invalid job spec: ") as err:
        spec(sampling=sampling)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_label_json_schema_must_be_an_object_schema_and_the_only_label():
    with pytest.raises(SpecError, match="label.json_schema must describe an object with properties"):
        spec(task="label", label={"json_schema": {"enum": ["a"]}})
    with pytest.raises(SpecError, match="drop label.choices"):
        spec(task="label", label={"json_schema": REVIEW, "choices": ["a"]})
    with pytest.raises(SpecError, match="drop sampling.structured_outputs"):
        spec(task="label", label={"json_schema": REVIEW}, sampling={"structured_outputs": {"regex": "a"}})


def test_fingerprint_is_unchanged_without_the_fields_and_follows_schema_content_not_path(tmp_path):
    plain = spec()
    assert spec(sampling={"structured_outputs": None}).fingerprint() == plain.fingerprint()
    assert spec(label={"choices": ["a"]}).fingerprint() == spec(label={"choices": ["a"], "json_schema": None}).fingerprint()
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "s.json").write_text(json.dumps(REVIEW))
    (tmp_path / "b.json").write_text(json.dumps(REVIEW, indent=2))
    (tmp_path / "c.json").write_text(json.dumps({**REVIEW, "required": ["score"]}))
    prints = []
    for name in ("a/s.json", "b.json", "c.json"):
        path = tmp_path / "job.yaml"
        path.write_text(f"input: {{path: in.jsonl}}\noutput: {{path: out/}}\nsampling:\n"
                        f"  structured_outputs: {{json: {name}}}\n")
        prints.append(load_spec(path).fingerprint())
    inline = spec(sampling={"structured_outputs": {"json": REVIEW}}).fingerprint()
    assert prints[0] == prints[1] == inline != plain.fingerprint()
    assert prints[2] != prints[0]
    with pytest.raises(SpecError, match="must be read before"):
        spec(sampling={"structured_outputs": {"json": "s.json"}}).fingerprint()


def test_schema_paths_are_relative_to_the_spec_file_and_read_once(tmp_path, monkeypatch):
    (tmp_path / "specs" / "schemas").mkdir(parents=True)
    (tmp_path / "specs" / "schemas" / "r.json").write_text(json.dumps(REVIEW))
    (tmp_path / "specs" / "job.yaml").write_text(
        "task: label\ninput: {path: in.jsonl}\noutput: {path: out/}\nlabel: {json_schema: schemas/r.json}\n")
    monkeypatch.chdir(tmp_path)  # elsewhere than the spec file
    assert load_spec("specs/job.yaml").label.json_schema == REVIEW
    # a --set value is relative to the working directory
    got = load_spec("specs/job.yaml", ["sampling.structured_outputs.json=specs/schemas/r.json", "task=generate",
                                       "label.json_schema=null"])
    assert got.sampling.structured_outputs.json == REVIEW
    with pytest.raises(SpecError, match=r"^label.json_schema: schema file .*nope.json not found$"):
        load_spec(None, ["input.path=x", "output.path=y", "task=label", "label.json_schema=nope.json"])
    (tmp_path / "bad.json").write_text("[1, 2")
    with pytest.raises(SpecError, match="sampling.structured_outputs.json: bad.json is not JSON"):
        load_spec(None, ["input.path=x", "output.path=y", "sampling.structured_outputs.json=bad.json"])


def test_grammars_compile_in_preflight_naming_key_and_cause(tiny):
    tok = tiny.runner.hf_tokenizer
    check_constraints(spec(sampling={"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}), tok)
    with pytest.raises(JobError, match=r"^sampling.structured_outputs.regex: .+") as err:
        check_constraints(spec(sampling={"structured_outputs": {"regex": "(unclosed"}}), tok)
    assert "\n" not in str(err.value)
    with pytest.raises(JobError, match=r"^sampling.structured_outputs.grammar: "):
        check_constraints(spec(sampling={"structured_outputs": {"grammar": "root ::= nope"}}), tok)
    bad = {**REVIEW, "properties": {**REVIEW["properties"], "code": {"type": "string", "pattern": "(x"}}}
    with pytest.raises(JobError, match=r"^label.json_schema: "):
        check_constraints(spec(task="label", label={"json_schema": bad}), tok)


def test_preflight_says_per_constraint_which_backend_runs_it_and_what_is_checked_after(tiny):
    tok = tiny.runner.hf_tokenizer
    one_of = {"type": "object", "properties": {"v": {"oneOf": [{"type": "integer"}, {"type": "boolean"}]}}}
    lines = check_constraints(spec(sampling={"structured_outputs": {"json": one_of}}), tok)
    assert lines == ["sampling.structured_outputs.json: guidance enforces every keyword; outputs are validated "
                     "after generation"]
    pinned = spec(sampling={"structured_outputs": {"json": one_of}}, engine={"structured_outputs_backend": "xgrammar"})
    assert check_constraints(pinned, tok) == ["sampling.structured_outputs.json: xgrammar; oneOf is enforced as "
                                              "anyOf; outputs are validated after generation"]
    assert check_constraints(spec(task="label", label={"json_schema": REVIEW}), tok) == [
        "label.json_schema: xgrammar enforces every keyword; outputs are validated after generation"]


def test_the_backend_counts_in_the_fingerprint_only_when_set():
    plain = spec(sampling={"structured_outputs": {"regex": "a+"}})
    same = spec(sampling={"structured_outputs": {"regex": "a+"}}, engine={"structured_outputs_backend": "auto"})
    other = spec(sampling={"structured_outputs": {"regex": "a+"}}, engine={"structured_outputs_backend": "guidance"})
    assert plain.fingerprint() == same.fingerprint() != other.fingerprint()


# -- rows -------------------------------------------------------------------------------------------

def test_a_row_that_breaks_its_constraint_is_an_error_that_keeps_its_finish_reason(tiny):
    """A stop string inside the object ends it early: once a success, now a row error counted by
    max_error_rate, with no label fields."""
    rows = [{"prompt": f"Review {i}: fine."} for i in range(3)]
    runner = TaskRunner(spec(task="label", label={"json_schema": REVIEW},
                             sampling={"max_tokens": 64, "temperature": 0, "stop": [","]}), tiny)
    results = runner.run(Row.batch(rows, ["0", "1", "2"]))
    for r in results:
        assert r.finish_reason == "stop" and r.error.startswith(f"{VIOLATION}is not JSON: "), r.error
        assert r.label_fields is None and r.failed
    table = pa.table({"finish_reason": [r.finish_reason for r in results], "error": [r.error for r in results],
                      "num_prompt_tokens": [1] * 3, "num_generated_tokens": [3] * 3})
    assert CommitRecord.counted(table).errors == 3



def test_label_fields_are_typed_from_the_schema():
    schema = {"type": "object", "required": ["s", "i"], "$defs": {"tag": {"enum": ["a", "b"]}},
              "properties": {"s": {"type": "string", "maxLength": 3}, "i": {"type": "integer"}, "n": {"type": "number"},
                             "b": {"type": "boolean"}, "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}},
                             "o": {"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"]},
                             "opt": {"type": ["integer", "null"]}, "mixed": {"anyOf": [{"type": "integer"},
                                                                                     {"type": "string"}]},
                             "c": {"const": True}}}
    t = fields_type(schema)
    assert t == pa.struct([pa.field("s", pa.string(), nullable=False), pa.field("i", pa.int64(), nullable=False),
                           ("n", pa.float64()), ("b", pa.bool_()), ("tags", pa.list_(pa.string())),
                           ("o", pa.struct([pa.field("k", pa.int64(), nullable=False)])), ("opt", pa.int64()),
                           ("mixed", pa.string()), ("c", pa.bool_())])
    value = field_values({"s": "x", "i": 3, "n": 1, "tags": ["a"], "o": {"k": 2}, "mixed": 7}, t)
    assert value == {"s": "x", "i": 3, "n": 1.0, "b": None, "tags": ["a"], "o": {"k": 2}, "opt": None,
                     "mixed": "7", "c": None}
    pa.array([value, None], t)  # a failed row's struct is null
    with pytest.raises(ValueError, match=r"label_fields.i: .* does not fit int64"):
        field_values({"s": "x", "i": 1 << 70}, t)


def test_a_required_property_that_admits_null_is_a_nullable_field():
    """Required means present, not non-null: a required property typed ["string", "null"], or
    anyOf with null, or an enum holding null, may be null, and its part must still be writable."""
    from pipeline.io import encode

    schema = {"type": "object", "required": ["a", "b", "e", "s"],
              "properties": {"a": {"type": ["string", "null"]}, "b": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                             "e": {"enum": ["x", None]}, "s": {"type": "string"}}}
    t = fields_type(schema)
    assert [t.field(i).nullable for i in range(t.num_fields)] == [True, True, True, False]
    value = field_values({"a": None, "b": None, "e": None, "s": "ok"}, t)
    encode(pa.table({"label_fields": pa.array([value], t)}), "parquet")  # raised ArrowInvalid before


def test_a_recursive_label_schema_types_its_recursion_as_json_text():
    """A tree whose nodes hold nodes, through #/$defs and through the root: the fields are typed
    down to where a reference refers back to a schema it is inside (RecursionError on every shard
    before), and a value of any depth is written."""
    from pipeline.io import encode

    node = {"type": "object", "properties": {"name": {"type": "string"},
                                             "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}
    schema = {"type": "object", "$defs": {"node": node},
              "properties": {"root": {"$ref": "#/$defs/node"}, "again": {"$ref": "#"}, "n": {"type": "integer"}}}
    t = fields_type(schema)
    root = t.field("root").type
    assert root.field("name").type == pa.string()
    assert root.field("children").type == pa.list_(pa.string())  # each child: JSON text
    assert t.field("again").type.field("again").type == pa.string() and t.field("n").type == pa.int64()
    value = field_values({"root": {"name": "a", "children": [{"name": "b", "children": [{"name": "c"}]}]}, "n": 1}, t)
    assert json.loads(value["root"]["children"][0]) == {"name": "b", "children": [{"name": "c"}]}
    encode(pa.table({"label_fields": pa.array([value], t)}), "parquet")
    validate({"task": "label", "label": {"json_schema": schema}, "input": {"path": "x.jsonl"},
              "output": {"path": "out"}})


def test_a_label_job_writes_label_json_and_typed_fields_and_cut_rows_are_errors(tiny):
    rows = [{"prompt": f"Review {i}: fine."} for i in range(4)]
    whole = TaskRunner(spec(task="label", label={"json_schema": REVIEW}, sampling={"max_tokens": 64,
                                                                                  "temperature": 0}), tiny)
    for r in whole.run(Row.batch(rows[:2], ["0", "1"])):
        assert r.finish_reason == "stop" and r.error is None
        assert json.loads(r.label) == {k: v for k, v in r.label_fields.items() if v is not None}
        assert r.label_fields["sentiment"] in ("pos", "neg") and 1 <= r.label_fields["score"] <= 5
    cut = TaskRunner(spec(task="label", label={"json_schema": REVIEW}, sampling={"max_tokens": 3}), tiny)
    results = cut.run(Row.batch(rows, [str(i) for i in range(4)]))
    for r in results:
        assert (r.finish_reason, r.error, r.label, r.label_fields) == ("length", INCOMPLETE, None, None)
    table = pa.table({"finish_reason": [r.finish_reason for r in results], "error": [r.error for r in results],
                      "num_prompt_tokens": [1] * 4, "num_generated_tokens": [3] * 4})
    assert CommitRecord.counted(table).errors == 4  # they count against max_error_rate


def test_openai_response_format_per_request(tiny):
    def line(i, body):
        return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": "Label this."}], "max_tokens": 48,
                         "temperature": 0, **body}}

    schema = {"name": "review", "strict": True, "schema": REVIEW}
    big = {"type": "object", "properties": {f"p{i}": {"type": "integer", "description": "x" * 64}
                                            for i in range(MAX_SCHEMA_BYTES // 64)}}
    lines = [line(0, {"response_format": {"type": "json_schema", "json_schema": schema}}),
             line(1, {"response_format": {"type": "json_object"}}),
             line(2, {"response_format": {"type": "text"}}),
             line(3, {"response_format": {"type": "json_schema", "json_schema": {
                 "schema": {"type": "object", "properties": {"a": {"type": "string", "pattern": "(x"}}}}}}),
             line(4, {"response_format": {"type": "yaml"}}),
             line(5, {"response_format": {"type": "json_schema", "json_schema": {"schema": big}}}),
             line(6, {"response_format": {"type": "json_schema", "json_schema": {**schema, "strict": "yes"}}}),
             line(7, {"response_format": {"type": "json_schema", "json_schema": schema}, "stop": [","]})]
    assert parse_request(lines[0]).sampling["structured_outputs"] == {"json": REVIEW}
    job = spec(input={"path": "x", "format": "openai_batch"}, output={"path": "o", "format": "openai_batch"})
    runner = TaskRunner(job, _chat(tiny))
    ids = [x["custom_id"] for x in lines]
    results = runner.run(Row.batch(lines, ids))
    out = [json.loads(x) for x in runner.openai_lines(Row.batch(lines, ids), results, created=0)]
    content = [o["response"]["body"]["choices"][0]["message"]["content"] if o["response"] else None for o in out]
    jsonschema_ok = json.loads(content[0])
    assert set(jsonschema_ok) <= set(REVIEW["properties"]) and jsonschema_ok["sentiment"] in ("pos", "neg")
    assert isinstance(json.loads(content[1]), dict) and content[2] is not None
    errors = {o["custom_id"]: o["error"] for o in out if o["error"]}
    assert set(errors) == {"r3", "r4", "r5", "r6", "r7"}
    assert errors["r7"]["message"].startswith(f"{VIOLATION}is not JSON: ")  # cut by its stop string
    assert errors["r3"]["code"] == "invalid_request" and "structured_outputs.json" in errors["r3"]["message"]
    assert 'type must be "text", "json_object" or "json_schema"' in errors["r4"]["message"]
    assert f"over the limit of {MAX_SCHEMA_BYTES}" in errors["r5"]["message"]
    assert "json_schema.strict must be true or false" in errors["r6"]["message"]


def _chat(engine):
    """The tiny engine with a minimal chat template (the builtin tokenizer has none)."""
    engine.tokenizer.hf.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    return engine


# -- a job end to end -------------------------------------------------------------------------------

@pytest.mark.usefixtures("ray_local")
def test_a_job_whose_structured_rows_are_cut_fails_on_max_error_rate(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"row {i}"} for i in range(3)])
    (tmp_path / "long.json").write_text(json.dumps(
        {"type": "object", "properties": {"t": {"type": "string", "minLength": 40}}, "required": ["t"]}))
    (tmp_path / "job.yaml").write_text(f"model: builtin:tiny\ninput: {{path: {tmp_path / 'in.jsonl'}}}\noutput: {{path: {tmp_path / 'out'}}}\n"
                                       "sampling: {max_tokens: 6, structured_outputs: {json: long.json}}\n")
    result = CliRunner().invoke(main, ["run", str(tmp_path / "job.yaml")], catch_exceptions=False)
    assert result.exit_code == 3, result.output
    rows = read_output(tmp_path / "out").to_pylist()
    assert [(r["finish_reason"], r["error"]) for r in rows] == [("length", INCOMPLETE)] * 3
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["errors"] == 3
    assert Path(tmp_path / "out" / "_job.json").exists()


def test_build_processor_reads_schema_files_too(tmp_path, monkeypatch):
    from pipeline import build_processor

    (tmp_path / "r.json").write_text(json.dumps(REVIEW))
    monkeypatch.chdir(tmp_path)
    processor = build_processor({"task": "label", "label": {"json_schema": "r.json"}})
    assert processor.spec.label.json_schema == REVIEW
