"""builtin:echo, the instant engine stand-in for scale tests: LLMEngine's surface, no model."""
from engine import EngineConfig, SamplingParams
from engine.echo import ECHO_MODEL, EchoEngine


def test_answers_every_prompt_in_order_with_a_fixed_token():
    llm = EchoEngine(EngineConfig(model=ECHO_MODEL, max_model_len=64))
    outs = llm.generate(["hello", [1, 72, 105], "", 7, "y" * 80], SamplingParams(max_tokens=3))
    assert [o.index for o in outs] == [0, 1, 2, 3, 4]
    assert outs[0].text == "xxx" and outs[0].num_generated_tokens == 3 and outs[0].finish_reason == "length"
    assert outs[0].num_prompt_tokens == len("hello") + 1 and outs[1].num_prompt_tokens == 3
    assert outs[2].error == "prompt is empty" and outs[3].finish_reason == "error"
    assert "exceeds max_model_len (64)" in outs[4].error
    assert llm.tokenizer.decode(outs[0].token_ids) == "xxx"


def test_scores_choices_by_their_token_counts():
    llm = EchoEngine()
    (row,) = llm.score_choices(["Sentiment:"], [[" positive", " no"]])
    assert row.num_tokens == [9, 3] and row.logprobs == [-9.0, -3.0] and row.error is None
