"""Hostile JSON Schemas (tests/data/hostile/schemas.json): a reference outside the schema is that
row's one-line error when the request is submitted, nothing is fetched (a local server counts the
requests it gets: none), a schema the check cannot evaluate fails its row alone, and every other
row of the batch completes."""
from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams, StructuredOutputsParams
from engine.structured.check import OutputCheck

CASES = json.loads((Path(__file__).resolve().parents[1] / "data" / "hostile" / "schemas.json").read_text())


@pytest.fixture(scope="module")
def server():
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


def _schema(case: dict, port: int):
    return json.loads(json.dumps(case["schema"]).replace("{port}", str(port)))


def test_hostile_schemas_fail_their_own_row_and_fetch_nothing(server):
    port, hits = server
    llm = LLMEngine(EngineConfig(model="builtin:tiny"))
    params = [SamplingParams(max_tokens=8, temperature=0.0,
                             structured_outputs=StructuredOutputsParams(json=_schema(c, port))) for c in CASES]
    plain = SamplingParams(max_tokens=4, temperature=0.0)
    outs = llm.generate(["hi"] * (len(CASES) + 1), params + [plain])
    for case, out in zip(CASES, outs):
        if case["expect"] is None:
            assert out.finish_reason != "error" or "points outside" not in (out.error or ""), case["case"]
        else:
            assert out.finish_reason == "error" and case["expect"] in out.error, (case["case"], out.error)
            assert "\n" not in out.error
    assert outs[-1].finish_reason == "length" and outs[-1].error is None  # the plain row completes
    assert hits == []


def test_the_check_never_retrieves_and_a_reference_it_cannot_resolve_is_the_rows_violation(server):
    """The walker refuses outside references first; the validator itself has an empty registry, so
    a reference it cannot resolve is that row's violation, never an exception out of generate."""
    port, hits = server
    check = OutputCheck(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": "#/$defs/gone"}}}))
    said = check.violation('{"a": 1}', accepted=True)
    assert said is not None and "could not be checked against the schema" in said and "\n" not in said
    assert hits == []
