"""Output side: parts committed atomically per shard, progress records, manifest, _SUCCESS.

Layout of an output directory:
    _job.json             the spec fingerprint: a rerun with another spec is refused
    data/part-<key>.*     one part per input shard, written whole or not at all
    _progress/<key>.json  the shard's commit record (counts, times), written after its part
    _plan/<block>.json    shards and rows planned by one planning task (for partial reports)
    _index/<run>/*.jsonl  the part index: one line per committed shard (see pipeline.index)
    metrics.json          task eval: metrics over the committed scores (written when complete)
    output.jsonl          openai_batch: every line, in input order (written when complete)
    errors.jsonl          openai_batch: the failed requests' lines (written when complete)
    manifest.json         counts, timings, versions, a pointer to the index (written when complete)
    _SUCCESS              written last
"""
from __future__ import annotations

import io
import json
import posixpath

import pyarrow as pa
import pyarrow.json  # noqa: F401  (registers the reader used by read_part)
import pyarrow.parquet as pq

from pipeline.storage import Storage

FINAL_FILES = ("metrics.json", "output.jsonl", "errors.jsonl")
"""Written from the committed parts once every shard is done (by task / format)."""

PLAN_DIR = "_plan"
"""Planning records, one per planning task."""

SUMMARY_FIELDS = ("rows", "errors", "skipped", "prompt_tokens", "generated_tokens", "cached_prompt_tokens")
"""Counts kept per shard and summed per job; `skipped` = malformed lines left out (on_bad_line: skip);
`cached_prompt_tokens` = prompt tokens served by the engine's prefix cache (0 in records written
before it was counted)."""


class OutputDir:
    """One job's output directory."""

    def __init__(self, storage: Storage, fmt: str):
        self.storage = storage
        self.format = fmt
        self.ext = "parquet" if fmt == "parquet" else "jsonl"

    # -- paths ----------------------------------------------------------------------------------

    def part_path(self, key: str) -> str:
        return self.storage.path("data", f"part-{key}.{self.ext}")

    def progress_path(self, key: str) -> str:
        return self.storage.path("_progress", f"{key}.json")

    # -- job record -----------------------------------------------------------------------------

    def read_json(self, name: str) -> dict | None:
        path = self.storage.path(name)
        return json.loads(self.storage.read_text(path)) if self.storage.exists(path) else None

    def write_json(self, name: str, data: dict) -> None:
        self.storage.write_atomic(self.storage.path(name), json.dumps(data, indent=1, default=str).encode())

    def is_complete(self) -> bool:
        return self.storage.exists(self.storage.path("_SUCCESS"))

    def mark_success(self) -> None:
        self.storage.write_atomic(self.storage.path("_SUCCESS"), b"")

    def clear(self) -> None:
        for name in ("_SUCCESS", "manifest.json", "_job.json", *FINAL_FILES):
            path = self.storage.path(name)
            if self.storage.exists(path):
                self.storage.fs.rm(path)
        for sub in ("data", "_progress", PLAN_DIR, "_index"):
            self.storage.remove_tree(self.storage.path(sub))

    # -- parts ----------------------------------------------------------------------------------

    def done_keys(self) -> set[str]:
        """Keys of the shards whose part is committed (one entry per shard, not per row)."""
        keys = set()
        for path in self.storage.list(self.storage.path("data")):
            name = posixpath.basename(path)
            if name.startswith("part-") and name.endswith("." + self.ext):
                keys.add(name[len("part-"): -len(self.ext) - 1])
        return keys

    def commit(self, key: str, table: pa.Table, summary: dict) -> str:
        """Writes the shard's part (atomically), then its progress record. Returns the part path."""
        path = self.part_path(key)
        self.storage.write_atomic(path, encode(table, self.format))
        self.storage.write_atomic(self.progress_path(key), json.dumps(summary).encode())
        return path

    def summary(self, key: str) -> dict:
        """A committed shard's counts: its progress record, or recounted from the part if the
        job died between the two writes."""
        path = self.progress_path(key)
        if self.storage.exists(path):
            return json.loads(self.storage.read_text(path))
        table = self.read_part(key)
        summary = summarize(table)
        self.storage.write_atomic(path, json.dumps(summary).encode())
        return summary

    def read_part(self, key: str) -> pa.Table:
        data = self.storage.read_bytes(self.part_path(key))
        if self.format == "parquet":
            # A native buffer: reading a Python file object with threads aborts at interpreter exit
            # once fsspec is imported (pyarrow 26).
            return pq.read_table(pa.BufferReader(data))
        lines = [line for line in data.decode("utf-8").splitlines() if line.strip()]
        if self.format == "openai_batch":
            return pa.table({"line": pa.array(lines, pa.string())})
        return pa.Table.from_pylist([json.loads(line) for line in lines])

    def iter_lines(self, keys: list[str]):
        """openai_batch: every committed line, part by part in `keys` order, as parsed dicts."""
        for key in keys:
            for line in self.read_part(key).column("line").to_pylist():
                yield line, json.loads(line)


def encode(table: pa.Table, fmt: str) -> bytes:
    if fmt == "openai_batch":
        return "".join(line + "\n" for line in table.column("line").to_pylist()).encode("utf-8")
    if fmt == "parquet":
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd")
        return buf.getvalue()
    return "".join(json.dumps(row, ensure_ascii=False, default=str) + "\n"
                   for row in table.to_pylist()).encode("utf-8")


def summarize(table: pa.Table) -> dict:
    """Counts over an output table: rows, errors, prompt and generated tokens, first causes."""
    if table.column_names == ["line"]:
        return _summarize_openai(table)
    d = table.select(["finish_reason", "error", "num_prompt_tokens", "num_generated_tokens"]).to_pydict()
    errors = [e for e, r in zip(d["error"], d["finish_reason"]) if r == "error"]
    return {
        "rows": table.num_rows,
        "errors": len(errors),
        "skipped": 0,
        "prompt_tokens": int(sum(d["num_prompt_tokens"])),
        "generated_tokens": int(sum(d["num_generated_tokens"])),
        "error_samples": errors[:3],
    }


def _summarize_openai(table: pa.Table) -> dict:
    """summarize() over OpenAI Batch output lines."""
    errors, prompt, generated = [], 0, 0
    for line in table.column("line").to_pylist():
        obj = json.loads(line)
        if obj["error"] is not None:
            errors.append(obj["error"]["message"])
        else:
            usage = obj["response"]["body"]["usage"]
            prompt += usage["prompt_tokens"]
            generated += usage["completion_tokens"]
    return {"rows": table.num_rows, "errors": len(errors), "skipped": 0, "prompt_tokens": prompt,
            "generated_tokens": generated, "error_samples": errors[:3]}
