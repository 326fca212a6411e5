"""Structured outputs on a real 32k SentencePiece vocabulary (random weights, so nothing would
parse without the constraint): valid JSON greedy and seeded in both modes, and the bounds that
untrusted constraints meet (a grammar too slow to compile fails its request alone)."""
from __future__ import annotations

import json
import time

import jsonschema
import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.api.config import SCHEDULING_MODES
from real_vocab import VOCAB, build_real_vocab_model
from schemas import SCHEMAS

SLOW_SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^([a-z]{1,9}){1,40}$"}},
               "required": ["a"]}
"""113 bytes whose nested repetition takes seconds to compile against 32k tokens."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_real_vocab_model(tmp_path_factory.mktemp("real_vocab"))


@pytest.fixture(scope="module")
def engines(model_dir):
    made = {}

    def get(mode: str) -> LLMEngine:
        if mode not in made:
            made[mode] = LLMEngine(EngineConfig(model=str(model_dir), max_num_seqs=32, scheduling=mode))
        return made[mode]

    return get


@pytest.mark.parametrize("mode", SCHEDULING_MODES)
def test_outputs_that_stop_validate_on_a_real_vocabulary_greedy_and_seeded(engines, mode):
    """The whole corpus (tests/engine/schemas.py: enums, bounded numbers, patterned strings,
    arrays, $ref, anyOf, optional properties, nested objects), one row per schema."""
    assert len(SCHEMAS) >= 30
    llm = engines(mode)
    assert llm.runner.vocab_size == VOCAB
    prompts = [f"Review {i}: the product arrived late but works. Label it as JSON." for i in range(len(SCHEMAS))]
    for label, temperature in (("greedy", 0.0), ("seeded", 1.0)):
        params = [SamplingParams(max_tokens=256, temperature=temperature, seed=i, structured_outputs={"json": s})
                  for i, s in enumerate(SCHEMAS)]
        outs = llm.generate(prompts, params)
        stopped = [(o, s) for o, s in zip(outs, SCHEMAS) if o.finish_reason == "stop"]
        for o, schema in stopped:
            jsonschema.validate(json.loads(o.text), schema)
        assert len(stopped) >= 0.9 * len(outs), f"{mode} {label}: {len(stopped)} of {len(outs)} stopped"
        # multi-character pieces were used, not only single characters
        assert sum(len(o.token_ids) for o, _ in stopped) < sum(len(o.text) for o, _ in stopped)


def test_a_grammar_too_slow_to_compile_fails_its_requests_alone(engines):
    llm = engines("continuous")
    llm.grammar.compile_timeout_s = 0.3
    try:
        start = time.perf_counter()
        outs = llm.generate(["a", "b", "c"], [
            SamplingParams(max_tokens=8, structured_outputs={"json": SLOW_SCHEMA}),
            SamplingParams(max_tokens=8, temperature=0, structured_outputs={"choice": ["yes", "no"]}),
            SamplingParams(max_tokens=8, structured_outputs={"json": SLOW_SCHEMA})])
        took = time.perf_counter() - start
    finally:
        llm.grammar.compile_timeout_s = 10.0
    assert outs[0].finish_reason == "error" and "did not compile within 0.3 s" in outs[0].error
    assert outs[2].error == outs[0].error  # remembered: the second row did not wait again
    assert outs[1].finish_reason == "stop" and outs[1].text in {"yes", "no"}
    assert took < 3.0, took
