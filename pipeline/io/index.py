"""The part index: one line per committed shard, in JSONL files next to the output.

manifest.json stays small (counts, usage, pointers); the list of parts lives here, written by
the driver as shard summaries stream in, ENTRIES_PER_FILE lines per file:

    _index/<run_id>/00000.jsonl   {"path", "shard", "file", "start", "stop", "rows", "errors", ...}

The run that completes the job indexes every shard (those committed by earlier runs come back
from their commit records), so its directory is the whole index; the manifest names it and its
files, and other runs' directories are removed. Readers: `entries(out, manifest)`.

Layout 1 (batchinfer before the index) listed the parts in manifest.json itself; those
manifests are still read here.
"""
from __future__ import annotations

import json
import posixpath
from typing import Iterator

from pipeline.io.manifest import Manifest
from pipeline.io.output import OutputDir
from pipeline.io.records import CommitRecord
from pipeline.io.storage import Storage

INDEX_DIR = "_index"
ENTRIES_PER_FILE = 10_000
"""Lines per index file: ~300 bytes each, so files of a few MB, 100 files per million shards."""

LAYOUT = 2
"""Output layout written by this version: 1 = parts listed in manifest.json, 2 = part index."""


class IndexWriter:
    """Collects index entries and writes them to storage in files of ENTRIES_PER_FILE lines."""

    def __init__(self, out: OutputDir, run_id: str):
        self.out = out
        self.dir = posixpath.join(INDEX_DIR, run_id)
        self.files: list[str] = []
        self.count = 0
        self._lines: list[str] = []

    def add(self, entry: CommitRecord) -> None:
        self._lines.append(entry.to_json())
        self.count += 1
        if len(self._lines) >= ENTRIES_PER_FILE:
            self.flush()

    def flush(self) -> None:
        if not self._lines:
            return
        name = f"{len(self.files):05d}.jsonl"
        data = "".join(line + "\n" for line in self._lines).encode("utf-8")
        self.out.storage.write_atomic(self.out.storage.path(self.dir, name), data)
        self.files.append(name)
        self._lines = []

    def pointer(self) -> dict:
        """What the manifest says about the index (written after the last flush)."""
        return {"dir": self.dir, "files": list(self.files), "parts": self.count, "format": "jsonl"}

    def remove_others(self) -> None:
        """Deletes index directories of earlier runs (partial, superseded by this one)."""
        root = self.out.storage.path(INDEX_DIR)
        try:
            listed = self.out.storage.fs.ls(root, detail=True)
        except FileNotFoundError:
            return
        mine = self.out.storage.path(self.dir).rstrip("/")
        for item in listed:
            if item.get("type") == "directory" and item["name"].rstrip("/") != mine:
                self.out.storage.remove_tree(item["name"])


def entries(out: OutputDir, manifest: Manifest) -> Iterator[dict]:
    """Every part of a complete output, one file of the index at a time (constant memory)."""
    index = manifest.index
    if index is None:  # layout 1: the parts are in the manifest
        yield from manifest.parts or []
        return
    for name in index["files"]:
        data = out.storage.read_text(out.storage.path(index["dir"], name))
        for line in data.splitlines():
            if line.strip():
                yield json.loads(line)


def part_entries(output_url: str, storage_options: dict | None = None) -> Iterator[dict]:
    """The parts of a complete output at `output_url`: what a reader of the results iterates."""
    out = OutputDir(Storage(output_url, storage_options or {}), "parquet")
    manifest = out.read_manifest()
    if manifest is None:
        raise FileNotFoundError(f"{output_url} has no manifest.json (the job is not complete)")
    return entries(out, manifest)
