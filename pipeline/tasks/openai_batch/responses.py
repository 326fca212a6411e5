"""OpenAI Batch output lines: a response line per row that ran, an error line per row that did not.

Lines have OpenAI's shape (`response_line`, `error_line`); their ids are derived from the
custom_id, so a rerun writes the same bytes. `output_lines` turns a shard's results into them.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pipeline.tasks.openai_batch.pooling import response_body as pooling_body
from pipeline.tasks.openai_batch.requests import CHAT_URL, COMPLETIONS_URL, URLS, BatchRequest

if TYPE_CHECKING:
    from pipeline.tasks.row_result import RowResult

INVALID_REQUEST = "invalid_request"
"""error_line code for a line that could not be parsed or validated."""
GENERATION_ERROR = "generation_error"
"""error_line code for a valid request the engine failed (prompt too long, ...)."""


@dataclass
class TokenLogprob:
    """One generated token's log-probability and its top alternatives, already decoded to text."""

    token: str
    logprob: float
    top: list[tuple[str, float]] = field(default_factory=list)
    """(token text, logprob) of the most likely tokens, most likely first."""


@dataclass
class Choice:
    """One of a response's choices: a sample of the request."""

    text: str
    finish_reason: str
    """"stop" or "length"."""
    logprobs: list[TokenLogprob] | None = None


def response_line(req: BatchRequest, *, text: str = "", finish_reason: str | None = None, prompt_tokens: int,
                  completion_tokens: int, model: str, created: int,
                  logprobs: list[TokenLogprob] | None = None, choices: list[Choice] | None = None) -> dict:
    """The output line of a request that ran: a chat.completion or text_completion body.

    text, finish_reason, logprobs: its one choice, or `choices`: all n of them (index = position).
    finish_reason: "stop" or "length" (failed rows go through `error_line`). created: Unix
    seconds; pass one value per job (e.g. its start) so that reruns write identical lines.
    logprobs: per generated token, when the request asked for them; completion text_offset
    values count from the start of the generated text. completion_tokens: over every choice.
    """
    if req.error is not None or req.url not in URLS or req.custom_id is None:
        raise ValueError("response_line needs a valid request; write failed requests with error_line")
    choices = [Choice(text, finish_reason, logprobs)] if choices is None else choices
    if not choices:
        raise ValueError("response_line needs at least one choice")
    for choice in choices:
        if choice.finish_reason not in ("stop", "length"):
            raise ValueError(f'finish_reason must be "stop" or "length", got {choice.finish_reason!r}; '
                             "write failed requests with error_line")
    for name, value in (("prompt_tokens", prompt_tokens), ("completion_tokens", completion_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    if req.is_chat:
        listed = [{"index": j, "message": {"role": "assistant", "content": c.text},
                   "finish_reason": c.finish_reason, "logprobs": _chat_logprobs(c.logprobs)}
                  for j, c in enumerate(choices)]
        body = {"id": "chatcmpl-" + _digest("completion", req.custom_id), "object": "chat.completion",
                "created": created, "model": model, "choices": listed, "usage": usage}
    else:
        listed = [{"index": j, "text": c.text, "finish_reason": c.finish_reason,
                   "logprobs": _completion_logprobs(c.logprobs)} for j, c in enumerate(choices)]
        body = {"id": "cmpl-" + _digest("completion", req.custom_id), "object": "text_completion",
                "created": created, "model": model, "choices": listed, "usage": usage}
    return {"id": _line_id(req.custom_id), "custom_id": req.custom_id,
            "response": {"status_code": 200, "request_id": _digest("request", req.custom_id), "body": body},
            "error": None}


def error_line(custom_id: str | None, code: str, message: str, *, row_id: str | None = None) -> dict:
    """The output line of a request that failed (also what goes to the errors file).

    The line id comes from custom_id, or from row_id (the job's row id) when the line had no
    usable custom_id."""
    key = custom_id if custom_id is not None else row_id
    if key is None:
        raise ValueError("error_line needs a custom_id or a row_id")
    line_key = key if custom_id is not None else f"row:{row_id}"
    return {"id": _line_id(line_key), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def _line_id(key: str) -> str:
    return "batch_req_" + _digest("line", key)


def _digest(kind: str, key: str) -> str:
    return hashlib.sha256(f"{kind}\0{key}".encode()).hexdigest()[:32]


def _chat_logprobs(logprobs: list[TokenLogprob] | None) -> dict | None:
    if logprobs is None:
        return None

    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**entry(t.token, t.logprob), "top_logprobs": [entry(tok, lp) for tok, lp in t.top]}
                        for t in logprobs],
            "refusal": None}


def _completion_logprobs(logprobs: list[TokenLogprob] | None) -> dict | None:
    if logprobs is None:
        return None
    offsets, offset = [], 0
    for t in logprobs:
        offsets.append(offset)
        offset += len(t.token)
    return {"tokens": [t.token for t in logprobs], "token_logprobs": [t.logprob for t in logprobs],
            "top_logprobs": [dict(t.top) for t in logprobs], "text_offset": offsets}


def request_for(row_id: str, chat: bool) -> BatchRequest:
    """An OpenAI request stand-in for rows that did not come from an OpenAI Batch file."""
    return BatchRequest(custom_id=row_id, url=CHAT_URL if chat else COMPLETIONS_URL)


def output_lines(rows: list[dict], ids: list[str], results: list[RowResult], *, openai_input: bool, chat: bool,
                 model: str, created: int, default_logprobs: int | None, tokenizer) -> list[str]:
    """One OpenAI Batch output line (JSON text) per row. `openai_input`: the rows are request lines
    (their custom_id names the line); `chat`: other rows' prompts were chat messages; `model`:
    the job's model, unless a request names its own; `created`: the job's creation time;
    `default_logprobs`: the spec's sampling.logprobs; `tokenizer` decodes logprob tokens."""
    lines = []
    for row, row_id, result in zip(rows, ids, results):
        samples = result.sample_results()
        failed = next((s for s in samples if s.failed), None)
        if failed is not None:  # a request's line holds all its samples or none: the first failure is its error
            custom_id = row.get("custom_id") if isinstance(row.get("custom_id"), str) else None
            code = GENERATION_ERROR if failed.ran else INVALID_REQUEST
            line = error_line(custom_id if openai_input else row_id, code, failed.error or "", row_id=row_id)
        elif result.pooled is not None:
            req = result.request
            body = pooling_body(req.url, req.pooling, result.pooled, model=req.model or model, created=created,
                                custom_id=req.custom_id)
            line = {"id": _line_id(req.custom_id), "custom_id": req.custom_id,
                    "response": {"status_code": 200, "request_id": _digest("request", req.custom_id), "body": body},
                    "error": None}
        else:
            req = result.request or request_for(row_id, chat=chat)
            top = req.sampling.get("logprobs", default_logprobs) or 0
            choices = [Choice(s.generated_text, s.finish_reason, None if s.logprobs is None else
                              [token_logprob(tokenizer, step, top) for step in s.logprobs]) for s in samples]
            line = response_line(req, choices=choices, prompt_tokens=result.num_prompt_tokens,
                                 completion_tokens=sum(s.num_generated_tokens for s in samples),
                                 model=req.model or model, created=created)
            if result.prompt_logprobs is not None:
                line["response"]["body"]["prompt_logprobs"] = prompt_logprobs_json(tokenizer, result.prompt_logprobs)
        lines.append(json.dumps(line, ensure_ascii=False))
    return lines


def prompt_logprobs_json(tokenizer, entries: list[dict[int, float] | None]) -> list[dict | None]:
    """The prompt logprobs of a line's body, as vLLM's server writes them: null for the first token,
    then per token {token id: {logprob, rank, decoded_token}}, rank 1 the most probable listed."""
    out: list[dict | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        order = sorted(entry, key=entry.get, reverse=True)
        out.append({str(t): {"logprob": lp, "rank": order.index(t) + 1, "decoded_token": tokenizer.decode([t])}
                    for t, lp in entry.items()})
    return out


def token_logprob(tokenizer, step: dict[int, float], n: int) -> TokenLogprob:
    """The engine's {token id: logprob} of one step (chosen token first, then the top n) as text."""
    (chosen, logprob), *_ = step.items()
    top = sorted(step.items(), key=lambda kv: -kv[1])[:n]
    return TokenLogprob(tokenizer.decode([chosen]), logprob, [(tokenizer.decode([t]), lp) for t, lp in top])
