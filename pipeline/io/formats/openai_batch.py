"""OpenAI Batch files. Input: JSONL request lines (read as jsonl; pipeline.tasks.openai_batch parses
each request, since that needs the engine's sampling parameters). Output: one response line a
request, as OpenAI writes them; a complete job's finish writes output.jsonl (every line, in input
order) and errors.jsonl (the failed ones)."""
from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING

import pyarrow as pa

from pipeline.io.records import CommitRecord

if TYPE_CHECKING:
    from pipeline.io.output import OutputDir

OUTPUT_FILE, ERROR_FILE = "output.jsonl", "errors.jsonl"


def encode(table: pa.Table) -> bytes:
    """A part's bytes: its `line` column, one response line a line."""
    return "".join(line + "\n" for line in table.column("line").to_pylist()).encode("utf-8")


def decode(data: bytes) -> pa.Table:
    lines = [line for line in data.decode("utf-8").splitlines() if line.strip()]
    return pa.table({"line": pa.array(lines, pa.string())})


def count(table: pa.Table) -> CommitRecord:
    """The counts over a part's response lines (CommitRecord.counted for this format)."""
    errors, prompt, generated = [], 0, 0
    for line in table.column("line").to_pylist():
        obj = json.loads(line)
        if obj["error"] is not None:
            errors.append(obj["error"]["message"])
        else:
            usage = obj["response"]["body"]["usage"]  # a pooling line's has no completion tokens
            prompt += usage.get("prompt_tokens", usage.get("total_tokens", 0))
            generated += usage.get("completion_tokens", 0)
    return CommitRecord(rows=table.num_rows, errors=len(errors), prompt_tokens=prompt, generated_tokens=generated,
                        error_samples=errors[:3])


def finish(out: OutputDir, parts: Iterable[dict]) -> dict:
    """output.jsonl (every line, in input order) and errors.jsonl (the failed ones) of a complete
    job, from its committed parts (index entries). Returns what the manifest says of them."""
    keys = [p["shard"] for p in sorted(parts, key=lambda p: (p["file"], p["start"]))]
    everything, failed = [], []
    for key in keys:
        for line in out.read_part(key).column("line").to_pylist():
            everything.append(line)
            if json.loads(line)["error"] is not None:
                failed.append(line)
    for name, lines in ((OUTPUT_FILE, everything), (ERROR_FILE, failed)):
        out.storage.write_atomic(out.storage.path(name), "".join(x + "\n" for x in lines).encode("utf-8"))
    return {"output_file": OUTPUT_FILE, "error_file": ERROR_FILE,
            "request_counts": {"total": len(everything), "completed": len(everything) - len(failed),
                               "failed": len(failed)}}
