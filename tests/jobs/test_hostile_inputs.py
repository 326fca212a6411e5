"""The hostile-input corpus (tests/data/hostile/): what rows, OpenAI Batch lines, model files and
adapter folders may carry that no user wrote by hand. Each case's expected outcome is written in
its data file: a one-line error of that row (`expect` quoted from it), or the row runs (`expect`
null). Every other row completes, no request reaches the network (a local server counts them:
none), and nothing outside the job's paths is read (file references and links refused).
Duplicate custom_ids, a job error before any work, need a whole job: tests/jobs/test_tasks.py."""
from __future__ import annotations

import http.server
import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams, StructuredOutputsParams
from engine.models.builtin import builtin_path
from engine.structured.check import OutputCheck
from jobs.spec import validate
from pipeline.errors import InputError
from pipeline.io.adapters import list_adapters
from pipeline.spec import Row
from pipeline.tasks.task_runner import TaskRunner

HOSTILE = Path(__file__).resolve().parents[1] / "data" / "hostile"


def corpus(name: str) -> list[dict]:
    return json.loads((HOSTILE / name).read_text())


@pytest.fixture(scope="module")
def server():
    """A local HTTP server that answers anything and counts what it is asked."""
    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"type": "string"}')

        def log_message(self, *args):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1], hits
    srv.shutdown()


@pytest.fixture(scope="module")
def tiny():
    return LLMEngine(EngineConfig(model="builtin:tiny"))


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def built(value, key: str | None = None, port: int = 0):
    """A case's value with its recipes made: {"build": N} under logit_bias / stop / content, and
    {"build_nest": N}; "NaN" / "Infinity" as numbers; {port} as the counting server's port."""
    if isinstance(value, dict) and set(value) == {"build"}:
        n = value["build"]
        return {"logit_bias": lambda: {str(i): 1 for i in range(n)}, "stop": lambda: [f"s{i}" for i in range(n)],
                "content": lambda: "x" * n}[key]()
    if isinstance(value, dict) and set(value) == {"build_nest"}:
        return nested(value["build_nest"])
    if isinstance(value, dict):
        return {k: built(v, k, port) for k, v in value.items()}
    if isinstance(value, list):
        return [built(v, key, port) for v in value]
    if value in ("NaN", "Infinity"):
        return float(value.replace("Infinity", "inf"))
    return value.replace("{port}", str(port)) if isinstance(value, str) else value


def schema_of(case: dict, port: int):
    if "build" in case:
        recipe = case["build"]
        return {"enum": [f"v{i}" for i in range(recipe["enum"])]} if "enum" in recipe else nested(recipe["nest"])
    return built(case["schema"], port=port)


def assert_outcome(case: dict, error: str | None, finish_reason: str | None = None):
    """A case with `expect` failed with that one-line error; one without it ran (a constrained row
    of a random model may still break its constraint: that is a violation, not a refusal)."""
    if case["expect"] is None:
        assert finish_reason != "error", (case["case"], error)
    else:
        assert error is not None and case["expect"] in error, (case["case"], error)
        assert "\n" not in error, (case["case"], error)


def test_constraints_fail_their_own_row_and_fetch_nothing(server, tiny):
    """Schemas and grammars (refused at submission, or run), in one batch with a plain row."""
    port, hits = server
    cases, params = [], []
    for case in corpus("schemas.json") + corpus("grammars.json"):
        try:
            constraint = (StructuredOutputsParams(json=schema_of(case, port)) if "grammar" not in case
                          else StructuredOutputsParams(grammar=case["grammar"]))
        except ValueError as exc:  # refused when the request is made: the row paths make it the row's error
            assert_outcome(case, str(exc), "error")
            continue
        cases.append(case)
        params.append(SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=constraint))
    outs = tiny.generate(["hi"] * (len(cases) + 1), params + [SamplingParams(max_tokens=4, temperature=0.0)])
    for case, out in zip(cases, outs):
        assert_outcome(case, out.error, out.finish_reason)
    assert outs[-1].finish_reason == "length" and outs[-1].error is None  # the plain row completes
    assert hits == []


@pytest.mark.parametrize("case", corpus("checks.json"), ids=lambda c: c["case"])
def test_the_checks_regexes_are_bounded_in_time(case):
    """A pattern that backtracks on what the model wrote is that row's violation within the bound
    (1 s of regex time per row), never a worker held for hours."""
    o = case["output"]
    text = o["repeat"] * o["times"] + o["then"]
    text = json.dumps({text: 1}) if o.get("key") else json.dumps(text) if o.get("json") else text
    check = OutputCheck(StructuredOutputsParams(json=case["schema"]) if "schema" in case
                        else StructuredOutputsParams(regex=case["regex"]))
    started = time.monotonic()
    said = check.violation(text, accepted=True)
    assert time.monotonic() - started < 5
    assert said is not None and case["expect"] in said and "\n" not in said, said


def test_the_check_never_retrieves_and_a_reference_it_cannot_resolve_is_the_rows_violation(server):
    port, hits = server
    check = OutputCheck(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": "#/$defs/gone"}}}))
    said = check.violation('{"a": 1}', accepted=True)
    assert said is not None and "could not be checked against the schema" in said and "\n" not in said
    assert hits == []


def test_rows_sampling_params_fail_their_own_row(tiny):
    cases = corpus("sampling_params.json")
    spec = validate({"model": "builtin:tiny", "input": {"path": "in.jsonl", "sampling_column": "params"},
                     "output": {"path": "out/"}, "sampling": {"max_tokens": 3, "temperature": 0}})
    rows = [{"prompt": "a", "params": built(c["params"], "params")} for c in cases] + [{"prompt": "a", "params": None}]
    started = time.monotonic()
    results = TaskRunner(spec, tiny).run(Row.batch(rows, [str(i) for i in range(len(rows))]))
    assert time.monotonic() - started < 20  # a million logit_bias keys are counted, not converted
    for case, result in zip(cases, results):
        assert_outcome(case, result.error, result.finish_reason)
    assert results[-1].error is None and results[-1].num_generated_tokens == 3


def test_openai_batch_lines_fail_their_own_line_and_fetch_nothing(server, tiny, tmp_path):
    port, hits = server
    cases = corpus("openai_batch.json")
    lines = [built(c["line"], port=port) for c in cases]
    spec = validate({"model": "builtin:tiny", "input": {"path": str(tmp_path / "in.jsonl"), "format": "openai_batch"},
                     "output": {"path": str(tmp_path / "out"), "format": "openai_batch"}})
    runner = TaskRunner(spec, tiny)
    ids = [x["custom_id"] for x in lines]
    results = runner.run(Row.batch(lines, ids))
    written = [json.loads(x) for x in runner.openai_lines(Row.batch(lines, ids), results, 1700000000)]
    for case, line, result in zip(cases, written, results):
        assert line["custom_id"] == case["line"]["custom_id"]  # ids are data: echoed as given
        assert_outcome(case, result.error, result.finish_reason)
        assert (line["error"] is None) == (case["expect"] is None), (case["case"], line)
    assert hits == []


@pytest.fixture(scope="module")
def templated(tmp_path_factory):
    """builtin:tiny with each hostile chat template of the corpus, as a model directory."""
    root = tmp_path_factory.mktemp("templates")
    models = {}
    for case in corpus("chat_templates.json"):
        model = root / case["case"].replace(" ", "_")
        shutil.copytree(builtin_path("builtin:tiny"), model)
        (model / "chat_template.jinja").write_text(case["template"])
        config = json.loads((model / "tokenizer_config.json").read_text())
        config.pop("chat_template", None)
        (model / "tokenizer_config.json").write_text(json.dumps(config))
        models[case["case"]] = model
    return models


@pytest.mark.parametrize("case", corpus("chat_templates.json"), ids=lambda c: c["case"])
def test_a_model_files_chat_template_runs_sandboxed_and_fails_its_row(case, templated):
    llm = LLMEngine(EngineConfig(model=str(templated[case["case"]])))
    spec = validate({"model": str(templated[case["case"]]), "input": {"path": "in.jsonl", "messages_column": "m"},
                     "output": {"path": "out/"}, "sampling": {"max_tokens": 2, "temperature": 0}})
    rows = [{"m": [{"role": "user", "content": text}]} for text in case["contents"]]
    results = TaskRunner(spec, llm).run(Row.batch(rows, [str(i) for i in range(len(rows))]))
    assert_outcome(case, results[0].error, results[0].finish_reason)
    assert all(r.error is None for r in results[1:]), [r.error for r in results]


def test_lora_path_links_leading_out_of_it_are_refused(tmp_path):
    """A folder of adapters is trusted as far as it goes: a subfolder, or an adapter file, that is a
    link to a place outside it is refused in one line, before anything reads it."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "adapter_config.json").write_text("{}")
    (outside / "secret.safetensors").write_text("not yours")
    folder = tmp_path / "adapters"
    (folder / "good").mkdir(parents=True)
    (folder / "good" / "adapter_config.json").write_text("{}")
    assert list(list_adapters(str(folder), {})) == ["good"]
    os.symlink(outside, folder / "linked")
    with pytest.raises(InputError, match=r"linked leads outside it") as raised:
        list_adapters(str(folder), {})
    assert "\n" not in str(raised.value)
    os.remove(folder / "linked")
    os.symlink(outside / "secret.safetensors", folder / "good" / "adapter_model.safetensors")
    with pytest.raises(InputError, match=r"good/adapter_model.safetensors leads outside it"):
        list_adapters(str(folder), {})

