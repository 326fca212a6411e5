"""OpenAI Batch files of a complete job: output.jsonl and errors.jsonl, as OpenAI writes them."""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.io import OutputDir


def write_batch_files(out: OutputDir, parts: Iterable[dict]) -> dict:
    """output.jsonl (every line, in input order) and errors.jsonl (the failed ones) of a complete
    job, from its committed parts (index entries). Returns what the manifest says of them."""
    keys = [p["shard"] for p in sorted(parts, key=lambda p: (p["file"], p["start"]))]
    everything, failed = [], []
    for line, obj in out.iter_lines(keys):
        everything.append(line)
        if obj["error"] is not None:
            failed.append(line)
    for name, lines in (("output.jsonl", everything), ("errors.jsonl", failed)):
        out.storage.write_atomic(out.storage.path(name), "".join(x + "\n" for x in lines).encode("utf-8"))
    return {"output_file": "output.jsonl", "error_file": "errors.jsonl",
            "request_counts": {"total": len(everything), "completed": len(everything) - len(failed),
                               "failed": len(failed)}}
