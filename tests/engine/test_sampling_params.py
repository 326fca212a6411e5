import pytest

from engine import EngineConfig, SamplingParams


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5),
    ("max_tokens", 0), ("max_tokens", -3), ("min_tokens", -1), ("repetition_penalty", 0.0),
    ("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("logprobs", -1), ("seed", -1),
    ("stop", [""]), ("stop_token_ids", [-4]), ("max_tokens", 2.5), ("temperature", "hot"),
    # beyond what the sampler can hold: each crashed the whole generate() call, every request lost
    ("logprobs", 5000), ("seed", 2 ** 63), ("stop_token_ids", [2 ** 63]),
    ("logit_bias", {1: 200.0}), ("logit_bias", {-1: 1.0}), ("logit_bias", {"x": 1.0}), ("logit_bias", [1]),
    ("logit_bias", {1: float("nan")}), ("allowed_token_ids", []), ("allowed_token_ids", [-1]),
    ("bad_words", [""]), ("bad_words", [3]), ("skip_special_tokens", "yes"), ("spaces_between_special_tokens", 1),
    ("temperature", float("inf")), ("top_p", float("nan")), ("presence_penalty", float("-inf")),
])
def test_invalid_values_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_a_temperature_too_small_to_divide_by_is_greedy():
    """1e-40 underflows float32 (the logits become inf and NaN): below 1e-5 it samples as
    greedy, as vLLM does; the largest values the sampler holds are accepted."""
    assert SamplingParams(temperature=1e-40).temperature == 0.0
    assert SamplingParams(temperature=1e-4).temperature == 1e-4
    assert SamplingParams(seed=2 ** 63 - 1, logprobs=20).seed == 2 ** 63 - 1


def test_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="\n").stop == ["\n"]


def test_token_options_are_normalised():
    p = SamplingParams(logit_bias={"5": 1, 7: -100}, bad_words="spam", allowed_token_ids=(3, 4))
    assert p.logit_bias == {5: 1.0, 7: -100.0} and p.bad_words == ["spam"] and p.allowed_token_ids == [3, 4]
    assert SamplingParams(logit_bias={}).logit_bias is None and p.token_ids_used() == [5, 7, 3, 4]


@pytest.mark.parametrize("field,value", [("max_batch_tokens", 0), ("max_num_seqs", -1), ("max_logprobs", 0),
                                         ("scheduling", "magic"), ("dtype", "float8"), ("device", "tpu")])
def test_engine_config_validates(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_every_field_is_documented():
    for cls in (EngineConfig, SamplingParams):
        docs = cls.field_docs()
        assert docs and all(docs.values()), [k for k, v in docs.items() if not v]
