"""The token options in a job's sampling section (logit_bias, allowed_token_ids, bad_words,
skip_special_tokens): the rows the engine writes under them, and their fingerprint."""
from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine
from pipeline.errors import SpecError
from pipeline.spec import validate
from pipeline.tasks import TaskRunner

BASE = {"input": {"path": "in.jsonl"}, "output": {"path": "out/"}}


@pytest.fixture(scope="module")
def tiny():
    return LLMEngine(EngineConfig(model="builtin:tiny"))


def test_a_jobs_sampling_section_carries_the_token_options(tiny):
    hf = tiny.tokenizer.hf
    a, b = hf.convert_tokens_to_ids(["a", "b"])
    sampling = {"max_tokens": 8, "seed": 1, "ignore_eos": True, "allowed_token_ids": [a, b], "bad_words": ["aa"]}
    runner = TaskRunner(validate({**BASE, "sampling": sampling}), tiny)
    results = runner.run([{"prompt": f"row {i}"} for i in range(4)], [str(i) for i in range(4)], [None] * 4)
    for r in results:
        assert r.error is None and set(r.generated_text) <= {"a", "b"} and "aa" not in r.generated_text and len(r.generated_text) == 8
    forced = TaskRunner(validate({**BASE, "sampling": {"max_tokens": 3, "temperature": 0, "ignore_eos": True,
                                                        "logit_bias": {str(b): 100}}}), tiny)
    assert forced.run([{"prompt": "x"}], ["0"], [None])[0].generated_text == "bbb"


def test_the_options_count_in_the_fingerprint_only_when_set():
    plain = validate(BASE).fingerprint()
    assert validate({**BASE, "sampling": {"bad_words": [], "skip_special_tokens": True}}).fingerprint() == plain
    assert validate({**BASE, "sampling": {"bad_words": ["x"]}}).fingerprint() != plain
    assert validate({**BASE, "sampling": {"logit_bias": {"1": 2}}}).fingerprint() != plain
    with pytest.raises(SpecError, match="sampling.logprobs .25. is above engine.max_logprobs .20."):
        validate({**BASE, "sampling": {"logprobs": 25}})
    with pytest.raises(SpecError, match="logit_bias"):
        validate({**BASE, "sampling": {"logit_bias": {"1": 500}}})
