"""OpenAI Batch API request lines: what each line asks for, or why it cannot run.

An input line is {"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
"body": {...}} (or a pooling line: "/v1/embeddings" | "/v1/score" | "/v1/rerank", parsed by
pipeline.tasks.openai_batch.pooling). `parse_request` turns one into a `BatchRequest`: the messages or prompt, the body's
sampling fields mapped to `engine.SamplingParams` keyword arguments, and either None or a clear
per-row error. Nothing here raises on bad input: a bad line is a row error, and the job goes on.

Body fields, by what happens to them:
    mapped      max_tokens, max_completion_tokens (chat; both -> max_tokens), temperature, top_p,
                stop, seed, presence_penalty, frequency_penalty, logprobs (+ top_logprobs for chat),
                n (1 .. engine.api.sampling_params.MAX_N: one line with n choices),
                logit_bias ({token id: bias in [-100, 100]}; an id outside the vocabulary fails its line)
                response_format (chat; {type: text | json_object | json_schema, json_schema: {name,
                schema, strict, description}} -> structured_outputs; always enforced, strict or not)
    checked     stream (only false), model (a string; reported in the response only)
    ignored     user, and for chat metadata and store: they describe the request, not how to
                generate it
    unknown     anything else (tools, ...): listed in
                BatchRequest.unknown; the caller makes that a row error or a warning with
                `unknown_fields_error`
A field set to null counts as absent, as in the OpenAI API. Values follow the OpenAI API ranges,
with two engine limits on top: top_p must be > 0 and seed must be >= 0. A body's JSON Schema is
untrusted input: over MAX_SCHEMA_BYTES it is refused here, and the engine bounds the time its
grammar may take to compile (engine.structured.COMPILE_TIMEOUT_S); either way only that request fails.

Output lines are pipeline.tasks.openai_batch.responses'; the final output.jsonl and errors.jsonl are
written by pipeline.io.formats.openai_batch.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from engine.api import MAX_N, check_sizes
from pipeline.tasks.openai_batch.pooling import KNOWN_FIELDS as POOLING_FIELDS
from pipeline.tasks.openai_batch.pooling import POOLING_URLS, PoolingRequest, PoolingRequestError, parse_pooling

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
URLS = (CHAT_URL, COMPLETIONS_URL)

ROLES = ("system", "developer", "user", "assistant")
"""Chat roles accepted; "developer" (OpenAI's newer name for system) is passed on as "system",
which is what chat templates know. Tool and function messages are refused."""

IGNORED_FIELDS = {CHAT_URL: ("user", "metadata", "store"), COMPLETIONS_URL: ("user",)}
"""Body fields accepted and ignored, per endpoint (the OpenAI completions API has no metadata or
store): end-user id, tags and storage choice do not change generation."""

VLLM_FIELDS = ("prompt_logprobs",)
"""Body fields of vLLM's server beyond OpenAI's API, which batchinfer reads as vLLM does."""
_COMMON_FIELDS = ("model", "max_tokens", "temperature", "top_p", "stop", "seed", "n", "presence_penalty",
                  "frequency_penalty", "logprobs", "stream", "logit_bias") + VLLM_FIELDS
KNOWN_FIELDS = {
    CHAT_URL: frozenset(_COMMON_FIELDS + IGNORED_FIELDS[CHAT_URL]
                        + ("messages", "max_completion_tokens", "top_logprobs", "response_format")),
    COMPLETIONS_URL: frozenset(_COMMON_FIELDS + IGNORED_FIELDS[COMPLETIONS_URL] + ("prompt",)),
}
"""Body fields understood per endpoint; any other is reported in BatchRequest.unknown."""

MAX_SCHEMA_BYTES = 64 << 10
"""Most bytes of a body's JSON Schema, as compact JSON text (a 100-property schema is ~5 KB)."""

@dataclass
class BatchRequest:
    """One parsed request line. Exactly one of messages / prompt is set when error is None."""

    custom_id: str | None
    """The caller's id of the request; None when missing or not a string."""
    url: str | None = None
    """CHAT_URL or COMPLETIONS_URL; None when the line's url is invalid."""
    messages: list[dict] | None = None
    """Chat requests: [{"role", "content": str}], text parts joined with newlines."""
    prompt: str | None = None
    """Completion requests: the prompt text."""
    sampling: dict = field(default_factory=dict)
    """Keyword arguments for engine.SamplingParams, only the fields the body sets."""
    model: str | None = None
    """The body's model name: informational, echoed in the response only."""
    error: str | None = None
    """Why this line cannot run, or None."""
    unknown: list[str] = field(default_factory=list)
    """Body fields this module does not understand, sorted."""
    pooling: PoolingRequest | None = None
    """A /v1/embeddings, /v1/score or /v1/rerank line: what it asks the engine to pool."""

    @property
    def is_chat(self) -> bool:
        return self.url == CHAT_URL


class _RowError(ValueError):
    """A problem with one line, reported as BatchRequest.error."""


# -- requests -------------------------------------------------------------------------------------


def parse_request(obj) -> BatchRequest:
    """Parses one decoded JSON line; never raises on bad input (see BatchRequest.error)."""
    if not isinstance(obj, dict):
        return BatchRequest(None, error=f"request line must be a JSON object, got {_kind(obj)}")
    custom_id = obj.get("custom_id")
    req = BatchRequest(custom_id if isinstance(custom_id, str) and custom_id else None)
    try:
        _parse_line(obj, req)
    except _RowError as exc:
        req.error = str(exc)
    return req


def unknown_fields_error(unknown: list[str]) -> str:
    """The row error (or warning) for body fields that are not understood."""
    return f"unsupported body fields: {', '.join(sorted(unknown))}"


def _parse_line(obj: dict, req: BatchRequest) -> None:
    if "custom_id" not in obj or obj["custom_id"] is None:
        raise _RowError("custom_id is missing")
    if not isinstance(obj["custom_id"], str) or not obj["custom_id"]:
        raise _RowError(f"custom_id must be a non-empty string, got {obj['custom_id']!r}")
    extra = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if extra:
        raise _RowError(f"unsupported request fields: {', '.join(extra)} (expected custom_id, method, url, body)")
    if obj.get("method") != "POST":
        raise _RowError(f'method must be "POST", got {obj.get("method")!r}')
    if obj.get("url") not in URLS + POOLING_URLS:
        raise _RowError(f"url must be one of {', '.join(URLS + POOLING_URLS)}, got {obj.get('url')!r}")
    req.url = obj["url"]
    body = obj.get("body")
    if body is None:
        raise _RowError("body is missing")
    if not isinstance(body, dict):
        raise _RowError(f"body must be a JSON object, got {_kind(body)}")
    if req.url in POOLING_URLS:
        req.unknown = sorted(set(body) - POOLING_FIELDS[req.url])
        req.model = _optional(body, "model", _check_str)
        try:
            req.pooling = parse_pooling(req.url, body)
        except PoolingRequestError as exc:
            raise _RowError(str(exc)) from None
        return
    req.unknown = sorted(set(body) - KNOWN_FIELDS[req.url])
    req.model = _optional(body, "model", _check_str)
    if req.is_chat:
        req.messages = parse_messages(body.get("messages"))
    else:
        req.prompt = _parse_prompt(body.get("prompt"))
    req.sampling = _parse_sampling(body, req.is_chat)


def parse_messages(messages, where: str = "body.messages") -> list[dict]:
    """Chat messages in OpenAI format -> [{role, content: str, or its text and image_url parts}];
    ValueError naming the problem."""
    if messages is None:
        raise _RowError(f"{where} is missing")
    if not isinstance(messages, list) or not messages:
        raise _RowError(f"{where} must be a non-empty list of {{role, content}}")
    return [_parse_message(f"{where}[{i}]", m) for i, m in enumerate(messages)]


def _parse_message(where: str, message) -> dict:
    if not isinstance(message, dict):
        raise _RowError(f"{where} must be an object with role and content, got {_kind(message)}")
    extra = sorted(k for k, v in message.items() if k not in ("role", "content") and v is not None)
    if extra:
        raise _RowError(f"{where} has unsupported fields: {', '.join(extra)}")
    role = message.get("role")
    if role not in ROLES:
        raise _RowError(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}")
    return {"role": "system" if role == "developer" else role,
            "content": _parse_content(where, message.get("content"))}


def _parse_content(where: str, content) -> str | list[dict]:
    """A message's content: its text (text parts joined by newlines), or where it holds image_url
    parts its parts in order (a vision-language model's processor renders them; a text-only model
    fails the row)."""
    if isinstance(content, str):
        return content
    if content is None:
        raise _RowError(f"{where}.content is missing")
    if not isinstance(content, list) or not content:
        raise _RowError(f"{where}.content must be a string or a non-empty list of text and image_url parts")
    texts, parts = [], []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise _RowError(f"{where}.content[{j}] must be an object, got {_kind(part)}")
        if part.get("type") == "image_url":
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url:
                raise _RowError(f"{where}.content[{j}].image_url.url must be a string (a data: or http(s) URL)")
            parts.append({"type": "image_url", "image_url": {"url": url}})
            continue
        if part.get("type") != "text":
            raise _RowError(f"{where}.content[{j}]: part type {part.get('type')!r} is not supported "
                            "(text and image_url)")
        if not isinstance(part.get("text"), str):
            raise _RowError(f"{where}.content[{j}].text must be a string")
        texts.append(part["text"])
        parts.append({"type": "text", "text": part["text"]})
    if len(parts) > len(texts):
        return parts
    return "\n".join(texts)


def _parse_prompt(prompt) -> str:
    if prompt is None:
        raise _RowError("body.prompt is missing")
    if isinstance(prompt, list):
        if prompt and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            raise _RowError("body.prompt as token ids is not supported; send the prompt text")
        if len(prompt) != 1:
            raise _RowError(f"body.prompt must be a string or a list of exactly one string "
                            f"(one request per line), got a list of {len(prompt)}")
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise _RowError(f"body.prompt must be a string, got {_kind(prompt)}")
    if not prompt:
        raise _RowError("body.prompt is empty")
    return prompt


def _parse_sampling(body: dict, chat: bool) -> dict:
    try:
        check_sizes({"stop": body.get("stop"), "logit_bias": body.get("logit_bias")})
    except ValueError as exc:
        raise _RowError(f"body.{exc}") from None
    sampling = {}
    max_tokens = _optional(body, "max_tokens", _check_int, 1)
    if chat:
        max_completion = _optional(body, "max_completion_tokens", _check_int, 1)
        if None not in (max_tokens, max_completion) and max_tokens != max_completion:
            raise _RowError(f"body.max_tokens ({max_tokens}) and body.max_completion_tokens "
                            f"({max_completion}) differ; set one of them")
        max_tokens = max_tokens if max_tokens is not None else max_completion
    _put(sampling, "max_tokens", max_tokens)
    _put(sampling, "temperature", _optional(body, "temperature", _check_number, 0.0, 2.0))
    top_p = _optional(body, "top_p", _check_number, 0.0, 1.0)
    if top_p == 0:
        raise _RowError("body.top_p must be > 0 (use temperature 0 for greedy decoding)")
    _put(sampling, "top_p", top_p)
    _put(sampling, "presence_penalty", _optional(body, "presence_penalty", _check_number, -2.0, 2.0))
    _put(sampling, "frequency_penalty", _optional(body, "frequency_penalty", _check_number, -2.0, 2.0))
    _put(sampling, "seed", _optional(body, "seed", _check_int, 0))
    _put(sampling, "stop", _optional(body, "stop", _check_stop))
    _put(sampling, "n", _optional(body, "n", _check_int, 1, MAX_N))
    if body.get("stream") is not None and body["stream"] is not False:
        raise _RowError(f"body.stream must be false, got {body['stream']!r}")
    _put(sampling, "logprobs", _parse_logprobs(body, chat))
    _put(sampling, "logit_bias", _parse_logit_bias(body.get("logit_bias")))
    # vLLM's extension; this and logprobs are bounded by the engine's max_logprobs, as vLLM's server
    # bounds them (a line over it is that line's error), not by OpenAI's 5 and 20
    _put(sampling, "prompt_logprobs", _optional(body, "prompt_logprobs", _check_int, 0))
    _put(sampling, "structured_outputs", _parse_response_format(body.get("response_format")))
    return sampling


def _parse_response_format(value) -> dict | None:
    """body.response_format -> structured_outputs keyword arguments, or None for plain text."""
    where = "body.response_format"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _RowError(f"{where} must be an object, got {_kind(value)}")
    kind = value.get("type")
    allowed = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
    if kind not in allowed:
        raise _RowError(f'{where}.type must be "text", "json_object" or "json_schema", got {kind!r}')
    extra = sorted(set(value) - allowed[kind])
    if extra:
        raise _RowError(f"{where} of type {kind} has unsupported fields: {', '.join(extra)}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _RowError(f"{where}.json_schema must be an object with a schema, got {_kind(spec)}")
    extra = sorted(set(spec) - {"name", "description", "schema", "strict"})
    if extra:
        raise _RowError(f"{where}.json_schema has unsupported fields: {', '.join(extra)}")
    for name, check in (("name", _check_str), ("description", _check_str), ("strict", _check_bool)):
        if spec.get(name) is not None:
            check(f"{where}.json_schema.{name}", spec[name])
    schema = spec.get("schema")
    if not isinstance(schema, (dict, bool)):
        raise _RowError(f"{where}.json_schema.schema must be a JSON Schema object, got {_kind(schema)}")
    size = len(json.dumps(schema, separators=(",", ":")))
    if size > MAX_SCHEMA_BYTES:
        raise _RowError(f"{where}.json_schema.schema is {size} bytes, over the limit of {MAX_SCHEMA_BYTES}")
    return {"json": schema}


def _parse_logit_bias(value) -> dict[int, float] | None:
    """body.logit_bias ({"token id": bias}, OpenAI's range -100 .. 100) -> SamplingParams.logit_bias."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _RowError(f"body.logit_bias must be an object of token ids to numbers, got {_kind(value)}")
    bias = {}
    for key, number in value.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise _RowError(f"body.logit_bias keys must be token ids, got {key!r}")
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not -100 <= number <= 100:
            raise _RowError(f"body.logit_bias[{key}] must be a number in [-100, 100], got {number!r}")
        bias[int(key)] = float(number)
    return bias or None


def _parse_logprobs(body: dict, chat: bool) -> int | None:
    if not chat:  # completions: logprobs = number of alternatives
        return _optional(body, "logprobs", _check_int, 0)
    wanted = _optional(body, "logprobs", _check_bool)
    top = _optional(body, "top_logprobs", _check_int, 0)
    if top is not None and not wanted:
        raise _RowError("body.top_logprobs needs body.logprobs: true")
    return (top or 0) if wanted else None


def _optional(body: dict, name: str, check, *args):
    """body[name] checked, or None when it is absent or null."""
    value = body.get(name)
    return None if value is None else check(f"body.{name}", value, *args)


def _put(sampling: dict, name: str, value) -> None:
    if value is not None:
        sampling[name] = value


def _check_str(where: str, value) -> str:
    if not isinstance(value, str):
        raise _RowError(f"{where} must be a string, got {_kind(value)}")
    return value


def _check_bool(where: str, value) -> bool:
    if not isinstance(value, bool):
        raise _RowError(f"{where} must be true or false, got {value!r}")
    return value


def _check_int(where: str, value, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _RowError(f"{where} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise _RowError(f"{where} must be {bounds}, got {value}")
    return value


def _check_number(where: str, value, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise _RowError(f"{where} must be a number, got {value!r}")
    if not low <= value <= high:
        raise _RowError(f"{where} must be in [{low:g}, {high:g}], got {value}")
    return float(value)


def _check_stop(where: str, value) -> list[str]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _RowError(f"{where} must be a non-empty string or a list of them, got {value!r}")
    return stops


def _kind(value) -> str:
    return "null" if value is None else type(value).__name__
