import pytest

from engine import EngineConfig, SamplingParams


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5),
    ("max_tokens", 0), ("max_tokens", -3), ("min_tokens", -1), ("repetition_penalty", 0.0),
    ("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("logprobs", -1), ("seed", -1),
    ("stop", [""]), ("stop_token_ids", [-4]), ("max_tokens", 2.5), ("temperature", "hot"),
])
def test_invalid_values_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="\n").stop == ["\n"]


@pytest.mark.parametrize("field,value", [("max_batch_tokens", 0), ("max_num_seqs", -1),
                                         ("scheduling", "magic"), ("dtype", "float8"), ("device", "tpu")])
def test_engine_config_validates(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_every_field_is_documented():
    for cls in (EngineConfig, SamplingParams):
        docs = cls.field_docs()
        assert docs and all(docs.values()), [k for k, v in docs.items() if not v]
