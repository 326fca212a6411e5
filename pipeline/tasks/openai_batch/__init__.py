"""OpenAI Batch lines on the task side: a request line parsed into what the engine runs
(requests.py; pooling.py for /v1/embeddings, /v1/score and /v1/rerank), the task over request lines
(lines.py: OpenAIBatchLines), and the response and error lines written for each (responses.py).
The files themselves (reading the input's lines, encoding the output's, output.jsonl and
errors.jsonl of a complete job) are pipeline.io.formats' (io imports no engine, and parsing a
request needs the engine's sampling parameters)."""
from pipeline.tasks.openai_batch.lines import OpenAIBatchLines
from pipeline.tasks.openai_batch.requests import BatchRequest, parse_messages, parse_request
from pipeline.tasks.openai_batch.responses import (Choice, TokenLogprob, error_line, output_lines, request_for,
                                                   response_line)

__all__ = ["BatchRequest", "Choice", "OpenAIBatchLines", "TokenLogprob", "error_line", "output_lines",
           "parse_messages", "parse_request", "request_for", "response_line"]
