"""OpenAI Batch lines that pool instead of generating: OpenAI's /v1/embeddings, and vLLM's
/v1/score and /v1/rerank, parsed into what the engine runs and answered in their shapes.

    /v1/embeddings  input (a string, a list of strings, token ids, or a list of token-id lists),
                    dimensions, encoding_format (float | base64), model, user (ignored)
    /v1/score       text_1 (a string or a list), text_2 (a string or a list), model
    /v1/rerank      query, documents (strings), top_n, model

A line's inputs run together with the other lines' (one engine call per kind and shard); a line
whose input is bad, or that the model cannot serve, fails alone."""
from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from engine.api import Engine

EMBEDDINGS_URL = "/v1/embeddings"
SCORE_URL = "/v1/score"
RERANK_URL = "/v1/rerank"
POOLING_URLS = (EMBEDDINGS_URL, SCORE_URL, RERANK_URL)
KNOWN_FIELDS = {EMBEDDINGS_URL: {"input", "dimensions", "encoding_format", "model", "user"},
                SCORE_URL: {"text_1", "text_2", "model", "user", "truncate_prompt_tokens"},
                RERANK_URL: {"query", "documents", "top_n", "model", "user", "truncate_prompt_tokens"}}
MAX_INPUTS = 2048
"""Most inputs (or pairs) one line may carry, as OpenAI limits an embeddings request."""


@dataclass
class PoolingRequest:
    """What one pooling line asks for."""

    kind: str
    """embed or score (a rerank line scores its query against each document)."""
    inputs: list = field(default_factory=list)
    """embed: texts or token-id lists; score: (text_1, text_2) pairs."""
    dimensions: int | None = None
    base64: bool = False
    top_n: int | None = None
    documents: list[str] | None = None


class PoolingRequestError(ValueError):
    """A problem with one pooling line (its row error)."""


def parse_pooling(url: str, body: dict) -> PoolingRequest:
    if url == EMBEDDINGS_URL:
        req = PoolingRequest("embed", _embedding_inputs(body.get("input")))
        dims = body.get("dimensions")
        if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
            raise PoolingRequestError(f"body.dimensions must be a positive integer, got {dims!r}")
        req.dimensions = dims
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise PoolingRequestError(f'body.encoding_format must be "float" or "base64", got {fmt!r}')
        req.base64 = fmt == "base64"
        return req
    if url == SCORE_URL:
        firsts, seconds = _texts(body.get("text_1"), "text_1"), _texts(body.get("text_2"), "text_2")
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise PoolingRequestError(f"body.text_1 has {len(firsts)} texts and body.text_2 {len(seconds)}: give one "
                                      "text_1, or lists of the same length")
        return PoolingRequest("score", list(zip(firsts, seconds)))
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise PoolingRequestError("body.query must be a non-empty string")
    docs = _texts(body.get("documents"), "documents")
    top_n = body.get("top_n")
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
        raise PoolingRequestError(f"body.top_n must be a positive integer, got {top_n!r}")
    return PoolingRequest("score", [(query, d) for d in docs], top_n=top_n, documents=docs)


def _embedding_inputs(value) -> list:
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        value = [value]
    if not isinstance(value, list) or not value:
        raise PoolingRequestError("body.input must be a string, a list of strings, token ids or lists of token ids")
    if len(value) > MAX_INPUTS:
        raise PoolingRequestError(f"body.input holds {len(value)} inputs, more than {MAX_INPUTS}")
    for i, item in enumerate(value):
        ok = (isinstance(item, str) and item) or (isinstance(item, list) and item and all(
            isinstance(t, int) and not isinstance(t, bool) for t in item))
        if not ok:
            raise PoolingRequestError(f"body.input[{i}] must be a non-empty string or list of token ids")
    return value


def _texts(value, name: str) -> list[str]:
    value = [value] if isinstance(value, str) else value
    if not isinstance(value, list) or not value or not all(isinstance(t, str) and t for t in value):
        raise PoolingRequestError(f"body.{name} must be a non-empty string or a non-empty list of them")
    if len(value) > MAX_INPUTS:
        raise PoolingRequestError(f"body.{name} holds {len(value)} texts, more than {MAX_INPUTS}")
    return value


def response_body(url: str, req: PoolingRequest, outputs: list, *, model: str, created: int, custom_id: str) -> dict:
    """The response body of a line whose outputs all ran, in the endpoint's shape."""
    tokens = sum(o.num_prompt_tokens for o in outputs)
    key = hashlib.sha256(f"pooling\0{custom_id}".encode()).hexdigest()[:32]
    if url == EMBEDDINGS_URL:
        data = [{"object": "embedding", "index": i, "embedding": _encoded(o.embedding, req.base64)}
                for i, o in enumerate(outputs)]
        return {"object": "list", "data": data, "model": model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    if url == SCORE_URL:
        return {"id": f"score-{key}", "object": "list", "created": created, "model": model,
                "data": [{"index": i, "object": "score", "score": o.score} for i, o in enumerate(outputs)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
    ranked = sorted(range(len(outputs)), key=lambda i: -outputs[i].score)[: req.top_n or len(outputs)]
    return {"id": f"rerank-{key}", "model": model, "usage": {"total_tokens": tokens},
            "results": [{"index": i, "document": {"text": req.documents[i]}, "relevance_score": outputs[i].score}
                        for i in ranked]}


def _encoded(vector: list[float], as_base64: bool):
    if not as_base64:
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


def run_lines(engine: Engine, requests: list[PoolingRequest], loras: list | None = None) -> list[tuple[list | None, str | None]]:
    """Runs every line's inputs (one engine call per kind); per line, (its outputs, None) or
    (None, why it failed: the first failed input's error, or what the model cannot serve).
    `loras`: with LoRA, each line's LoRARequest (None: the base model)."""
    from engine.api import PoolingParams

    results: list[tuple[list | None, str | None]] = [(None, None)] * len(requests)
    for kind in ("embed", "score"):
        lines = [i for i, r in enumerate(requests) if r.kind == kind]
        if not lines:
            continue
        flat = [(i, item) for i in lines for item in requests[i].inputs]
        lora = {} if loras is None else {"lora_request": [loras[i] for i, _ in flat]}
        refusal = engine.refusal(kind)  # a model that cannot serve the endpoint: every such line's error
        if refusal is not None:
            for i in lines:
                results[i] = (None, refusal)
            continue
        if kind == "embed":
            outs = engine.embed([item for _, item in flat],
                                [PoolingParams(dimensions=requests[i].dimensions) for i, _ in flat], **lora)
        else:
            outs = engine.score([a for _, (a, _) in flat], [b for _, (_, b) in flat], **lora)
        per_line: dict[int, list] = {i: [] for i in lines}
        for (i, _), out in zip(flat, outs):
            per_line[i].append(out)
        for i, outs_i in per_line.items():
            failed = next((o.error for o in outs_i if o.error is not None), None)
            results[i] = (None, failed) if failed is not None else (outs_i, None)
    return results
