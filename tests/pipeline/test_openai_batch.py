import json

import pytest
from openai.types import BatchError, Completion
from openai.types import completion_create_params as completion_params
from openai.types.chat import ChatCompletion
from openai.types.chat import completion_create_params as chat_params
from pydantic import TypeAdapter

from pipeline.tasks.openai_batch.requests import (CHAT_URL, COMPLETIONS_URL, KNOWN_FIELDS, VLLM_FIELDS, BatchRequest, parse_request,
                                            unknown_fields_error)
from pipeline.tasks.openai_batch.responses import Choice, TokenLogprob, error_line, response_line


def chat(body=None, **line):
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Hi"}], **(body or {})}
    return {"custom_id": "req-1", "method": "POST", "url": CHAT_URL, "body": body, **line}


def completion(body=None, **line):
    body = {"model": "gpt-3.5-turbo-instruct", "prompt": "Say hi", **(body or {})}
    return {"custom_id": "req-2", "method": "POST", "url": COMPLETIONS_URL, "body": body, **line}


def error_of(obj) -> str | None:
    return parse_request(obj).error


# -- requests -------------------------------------------------------------------------------------


def test_known_fields_are_real_openai_fields():
    extra = {"stream", *VLLM_FIELDS}
    assert KNOWN_FIELDS[CHAT_URL] <= set(chat_params.CompletionCreateParamsBase.__annotations__) | extra
    assert KNOWN_FIELDS[COMPLETIONS_URL] <= set(completion_params.CompletionCreateParamsBase.__annotations__) | extra


def test_valid_chat_request():
    body = {"model": "gpt-4o-mini",
            "messages": [{"role": "developer", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Hello"},
                                                      {"type": "text", "text": "world"}]},
                         {"role": "assistant", "content": "Hi.", "name": None},
                         {"role": "user", "content": "Again"}],
            "max_completion_tokens": 32, "temperature": 0.5, "top_p": 0.9, "stop": "\n", "seed": 7, "n": 1,
            "presence_penalty": 0.1, "frequency_penalty": -0.2, "logprobs": True, "top_logprobs": 3,
            "stream": False, "user": "u1", "metadata": {"k": "v"}, "store": False}
    TypeAdapter(chat_params.CompletionCreateParamsNonStreaming).validate_python(body)  # a real OpenAI request
    req = parse_request(chat(body))
    assert req == BatchRequest(
        custom_id="req-1", url=CHAT_URL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello\nworld"},
                  {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again"}],
        prompt=None,
        sampling={"max_tokens": 32, "temperature": 0.5, "top_p": 0.9, "presence_penalty": 0.1,
                  "frequency_penalty": -0.2, "seed": 7, "stop": ["\n"], "n": 1, "logprobs": 3},
        model="gpt-4o-mini", error=None, unknown=[])
    assert req.is_chat


def test_valid_completion_request():
    body = {"model": "m", "prompt": ["Once upon"], "max_tokens": 5, "logprobs": 2, "stop": ["a", "b"],
            "temperature": 0, "seed": None}
    TypeAdapter(completion_params.CompletionCreateParamsNonStreaming).validate_python(body)
    req = parse_request(completion(body))
    assert req.error is None and not req.is_chat
    assert req.prompt == "Once upon" and req.messages is None
    assert req.sampling == {"max_tokens": 5, "temperature": 0.0, "stop": ["a", "b"], "logprobs": 2}
    assert parse_request(completion()).sampling == {}  # nothing set: the job's sampling applies


def test_max_tokens_aliases():
    assert parse_request(chat({"max_tokens": 9})).sampling == {"max_tokens": 9}
    assert parse_request(chat({"max_tokens": 9, "max_completion_tokens": 9})).sampling == {"max_tokens": 9}
    assert error_of(chat({"max_tokens": 9, "max_completion_tokens": 8})) == (
        "body.max_tokens (9) and body.max_completion_tokens (8) differ; set one of them")
    assert parse_request(completion({"max_completion_tokens": 9})).unknown == ["max_completion_tokens"]


def test_chat_logprobs_mapping():
    assert parse_request(chat({"logprobs": True})).sampling == {"logprobs": 0}
    assert parse_request(chat({"logprobs": False})).sampling == {}
    assert error_of(chat({"top_logprobs": 2})) == "body.top_logprobs needs body.logprobs: true"
    assert error_of(chat({"logprobs": 2})) == "body.logprobs must be true or false, got 2"
    # above OpenAI's 20 and 5: the engine's max_logprobs decides, as vLLM's server (tests/jobs/test_sampling_options.py)
    assert parse_request(chat({"logprobs": True, "top_logprobs": 21})).sampling == {"logprobs": 21}
    assert error_of(chat({"logprobs": True, "top_logprobs": -1})) == "body.top_logprobs must be >= 0, got -1"
    assert error_of(completion({"logprobs": True})) == "body.logprobs must be an integer, got True"
    assert parse_request(completion({"logprobs": 6})).sampling["logprobs"] == 6


@pytest.mark.parametrize("obj, message", [
    (["not", "an", "object"], "request line must be a JSON object, got list"),
    ({"method": "POST", "url": CHAT_URL, "body": {}}, "custom_id is missing"),
    (chat(custom_id=""), "custom_id must be a non-empty string, got ''"),
    (chat(custom_id=5), "custom_id must be a non-empty string, got 5"),
    (chat(extra=1), "unsupported request fields: extra (expected custom_id, method, url, body)"),
    (chat(method="GET"), "method must be \"POST\", got 'GET'"),
    ({"custom_id": "a", "url": CHAT_URL, "body": {}}, "method must be \"POST\", got None"),
    (chat(url="/v1/moderations"), "url must be one of /v1/chat/completions, /v1/completions, /v1/embeddings, "
     "/v1/score, /v1/rerank, got '/v1/moderations'"),
    ({"custom_id": "a", "method": "POST", "url": CHAT_URL}, "body is missing"),
    (chat(body=None) | {"body": "text"}, "body must be a JSON object, got str"),
    (chat({"model": 3}), "body.model must be a string, got int"),
    # chat messages
    (chat({"messages": None}), "body.messages is missing"),
    (chat({"messages": []}), "body.messages must be a non-empty list of {role, content}"),
    (chat({"messages": ["hi"]}), "body.messages[0] must be an object with role and content, got str"),
    (chat({"messages": [{"role": "tool", "content": "x", "tool_call_id": "t"}]}),
     "body.messages[0] has unsupported fields: tool_call_id"),
    (chat({"messages": [{"role": "tool", "content": "x"}]}),
     "body.messages[0].role must be one of system, developer, user, assistant, got 'tool'"),
    (chat({"messages": [{"role": "user"}]}), "body.messages[0].content is missing"),
    (chat({"messages": [{"role": "user", "content": 3}]}),
     "body.messages[0].content must be a string or a non-empty list of text and image_url parts"),
    (chat({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}]}),
     "body.messages[0].content[0]: part type 'input_audio' is not supported (text and image_url)"),
    (chat({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 3}}]}]}),
     "body.messages[0].content[0].image_url.url must be a string (a data: or http(s) URL)"),
    (chat({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}),
     "body.messages[0].content[0].text must be a string"),
    (chat({"messages": [{"role": "user", "content": ["x"]}]}), "body.messages[0].content[0] must be an object, got str"),
    # completion prompts
    (completion({"prompt": None}), "body.prompt is missing"),
    (completion({"prompt": ""}), "body.prompt is empty"),
    (completion({"prompt": ["a", "b"]}),
     "body.prompt must be a string or a list of exactly one string (one request per line), got a list of 2"),
    (completion({"prompt": [1, 2, 3]}), "body.prompt as token ids is not supported; send the prompt text"),
    (completion({"prompt": {"text": "x"}}), "body.prompt must be a string, got dict"),
    # sampling
    (chat({"n": 0}), "body.n must be in [1, 128], got 0"),
    (chat({"n": 129}), "body.n must be in [1, 128], got 129"),
    (chat({"n": True}), "body.n must be an integer, got True"),
    (chat({"stream": True}), "body.stream must be false, got True"),
    (chat({"max_tokens": 0}), "body.max_tokens must be >= 1, got 0"),
    (chat({"max_tokens": "10"}), "body.max_tokens must be an integer, got '10'"),
    (chat({"max_completion_tokens": 1.5}), "body.max_completion_tokens must be an integer, got 1.5"),
    (chat({"temperature": 2.5}), "body.temperature must be in [0, 2], got 2.5"),
    (chat({"temperature": "hot"}), "body.temperature must be a number, got 'hot'"),
    (chat({"top_p": 0}), "body.top_p must be > 0 (use temperature 0 for greedy decoding)"),
    (chat({"top_p": 1.5}), "body.top_p must be in [0, 1], got 1.5"),
    (chat({"presence_penalty": 3}), "body.presence_penalty must be in [-2, 2], got 3"),
    (chat({"frequency_penalty": -2.1}), "body.frequency_penalty must be in [-2, 2], got -2.1"),
    (chat({"seed": -1}), "body.seed must be >= 0, got -1"),
    (chat({"stop": ["ok", ""]}), "body.stop must be a non-empty string or a list of them, got ['ok', '']"),
    (completion({"stop": 5}), "body.stop must be a non-empty string or a list of them, got 5"),
])
def test_every_error_is_a_row_error(obj, message):
    req = parse_request(obj)
    assert req.error == message


def test_custom_id_is_kept_when_the_line_is_invalid():
    req = parse_request(chat(method="GET", custom_id="keep-me"))
    assert req.custom_id == "keep-me" and req.error
    assert parse_request(chat(custom_id=5)).custom_id is None


def test_unknown_fields_are_reported():
    req = parse_request(chat({"tools": [], "parallel_tool_calls": True}))
    assert req.error is None and req.unknown == ["parallel_tool_calls", "tools"]
    assert unknown_fields_error(req.unknown) == "unsupported body fields: parallel_tool_calls, tools"
    assert parse_request(completion({"echo": True, "best_of": 2})).unknown == ["best_of", "echo"]
    # the completions API has no response_format (chat only, as in OpenAI's API)
    assert parse_request(completion({"response_format": {"type": "text"}})).unknown == ["response_format"]
    assert parse_request(completion({"user": "x", "metadata": {}})).unknown == ["metadata"]  # chat only
    assert parse_request(chat({"user": "x", "metadata": {}, "store": True})).unknown == []


# -- responses ------------------------------------------------------------------------------------


def roundtrip(line: dict) -> dict:
    """What a client reads back from the JSONL output file."""
    return json.loads(json.dumps(line))


def test_chat_response_is_a_valid_chat_completion():
    req = parse_request(chat())
    line = roundtrip(response_line(req, text="Hello there", finish_reason="stop", prompt_tokens=12,
                                   completion_tokens=3, model="builtin:tiny", created=1700000000))
    assert line["custom_id"] == "req-1" and line["error"] is None
    assert line["id"].startswith("batch_req_") and line["response"]["status_code"] == 200
    assert isinstance(line["response"]["request_id"], str)
    parsed = ChatCompletion.model_validate(line["response"]["body"])
    assert parsed.object == "chat.completion" and parsed.id.startswith("chatcmpl-")
    assert parsed.choices[0].message.content == "Hello there"
    assert parsed.choices[0].message.role == "assistant"
    assert parsed.choices[0].finish_reason == "stop"
    assert parsed.usage.total_tokens == 15 and parsed.usage.prompt_tokens == 12
    assert parsed.model == "builtin:tiny" and parsed.created == 1700000000
    assert not parsed.model_extra and not parsed.choices[0].model_extra


def test_completion_response_is_a_valid_completion():
    req = parse_request(completion())
    line = roundtrip(response_line(req, text=" hi", finish_reason="length", prompt_tokens=2,
                                   completion_tokens=1, model="m", created=1))
    parsed = Completion.model_validate(line["response"]["body"])
    assert parsed.object == "text_completion" and parsed.id.startswith("cmpl-")
    assert parsed.choices[0].text == " hi" and parsed.choices[0].finish_reason == "length"
    assert parsed.usage.total_tokens == 3
    assert not parsed.model_extra and not parsed.choices[0].model_extra


def test_n_choices_in_one_line_each_with_its_index():
    assert parse_request(chat({"n": 3})).sampling["n"] == 3
    choices = [Choice("a", "stop"), Choice("bb", "length", [TokenLogprob("b", -0.2)]), Choice("", "stop")]
    line = roundtrip(response_line(parse_request(chat({"n": 3})), choices=choices, prompt_tokens=4,
                                   completion_tokens=5, model="m", created=1))
    parsed = ChatCompletion.model_validate(line["response"]["body"])
    assert [(c.index, c.message.content, c.finish_reason) for c in parsed.choices] == [
        (0, "a", "stop"), (1, "bb", "length"), (2, "", "stop")]
    assert parsed.choices[1].logprobs.content[0].logprob == -0.2 and parsed.choices[0].logprobs is None
    text = Completion.model_validate(roundtrip(response_line(
        parse_request(completion({"n": 2})), choices=choices[:2], prompt_tokens=1, completion_tokens=3, model="m",
        created=1))["response"]["body"])
    assert [(c.index, c.text) for c in text.choices] == [(0, "a"), (1, "bb")] and text.usage.total_tokens == 4
    with pytest.raises(ValueError, match="finish_reason must be"):
        response_line(parse_request(chat()), choices=[Choice("a", "stop"), Choice("", "error")], prompt_tokens=1,
                      completion_tokens=1, model="m", created=1)


def test_logprobs_in_responses():
    tokens = [TokenLogprob("Hé", -0.5, [("Hé", -0.5), ("H", -1.5)]), TokenLogprob("!", -0.1, [("!", -0.1)])]
    chat_line = response_line(parse_request(chat({"logprobs": True, "top_logprobs": 2})), text="Hé!",
                              finish_reason="stop", prompt_tokens=1, completion_tokens=2, model="m", created=1,
                              logprobs=tokens)
    lp = ChatCompletion.model_validate(roundtrip(chat_line)["response"]["body"]).choices[0].logprobs
    assert [t.token for t in lp.content] == ["Hé", "!"]
    assert lp.content[0].bytes == list("Hé".encode()) and lp.content[0].top_logprobs[1].logprob == -1.5
    comp_line = response_line(parse_request(completion({"logprobs": 2})), text="Hé!", finish_reason="stop",
                              prompt_tokens=1, completion_tokens=2, model="m", created=1, logprobs=tokens)
    lp = Completion.model_validate(roundtrip(comp_line)["response"]["body"]).choices[0].logprobs
    assert lp.tokens == ["Hé", "!"] and lp.token_logprobs == [-0.5, -0.1]
    assert lp.top_logprobs == [{"Hé": -0.5, "H": -1.5}, {"!": -0.1}] and lp.text_offset == [0, 2]


def test_ids_are_deterministic_and_distinct():
    kw = dict(text="x", finish_reason="stop", prompt_tokens=1, completion_tokens=1, model="m", created=1)
    a1 = response_line(parse_request(chat()), **kw)
    a2 = response_line(parse_request(chat()), **kw)
    b = response_line(parse_request(chat(custom_id="req-other")), **kw)
    assert a1 == a2
    assert len({a1["id"], b["id"]}) == 2
    assert len({a1["response"]["request_id"], b["response"]["request_id"]}) == 2
    assert a1["response"]["body"]["id"] != b["response"]["body"]["id"]
    assert error_line("req-1", "generation_error", "boom")["id"] == a1["id"]  # same line id either way


def test_response_line_refuses_what_it_cannot_write():
    kw = dict(text="x", prompt_tokens=1, completion_tokens=1, model="m", created=1)
    with pytest.raises(ValueError, match="finish_reason must be"):
        response_line(parse_request(chat()), finish_reason="error", **kw)
    with pytest.raises(ValueError, match="needs a valid request"):
        response_line(parse_request(chat(method="GET")), finish_reason="stop", **kw)
    with pytest.raises(ValueError, match="prompt_tokens must be a non-negative integer"):
        response_line(parse_request(chat()), finish_reason="stop", **{**kw, "prompt_tokens": -1})


def test_error_line():
    line = roundtrip(error_line("req-9", "invalid_request", "body.n must be 1"))
    assert line["custom_id"] == "req-9" and line["response"] is None and line["id"].startswith("batch_req_")
    err = BatchError.model_validate(line["error"])
    assert err.code == "invalid_request" and err.message == "body.n must be 1"
    assert set(line) == {"id", "custom_id", "response", "error"}
    # a line without a usable custom_id is named by the job's row id
    anon = error_line(None, "invalid_request", "custom_id is missing", row_id="f0:12")
    assert anon["custom_id"] is None and anon["id"] != error_line(None, "x", "y", row_id="f0:13")["id"]
    with pytest.raises(ValueError, match="needs a custom_id or a row_id"):
        error_line(None, "invalid_request", "x")


def test_logit_bias_maps_to_the_sampling_option_and_is_checked():
    assert parse_request(chat({"logit_bias": {"1": 2, "50256": -100}})).sampling["logit_bias"] == {1: 2.0, 50256: -100.0}
    assert parse_request(completion({"logit_bias": {"7": 0.5}})).sampling["logit_bias"] == {7: 0.5}
    assert "logit_bias" not in parse_request(chat({"logit_bias": None})).sampling
    assert parse_request(chat({"logit_bias": {"x": 1}})).error == "body.logit_bias keys must be token ids, got 'x'"
    assert parse_request(chat({"logit_bias": {"1": 101}})).error == \
        "body.logit_bias[1] must be a number in [-100, 100], got 101"
    assert parse_request(chat({"logit_bias": [1]})).error.startswith("body.logit_bias must be an object")
