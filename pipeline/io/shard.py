"""A shard: the unit of work, commit and resume, a contiguous range of rows of one input file."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class Shard:
    """A contiguous range of rows of one input file."""

    file: str
    """Path on the input filesystem."""
    name: str
    """The file's name relative to the input root: the stable part of derived row ids."""
    format: str
    """jsonl | parquet"""
    start: int
    """First row (JSONL: line) number, 0-based."""
    stop: int
    """One past the last row."""
    byte_start: int = 0
    """JSONL: byte offset of line `start`. Parquet: the rows' proportional share of the file's
    bytes (it measures progress; reads go by rows)."""
    byte_stop: int = 0
    """JSONL: byte offset just past line `stop - 1`. Parquet: as byte_start."""
    lora_each: bool = False
    """lora.each: this unit is the rows under one adapter (`adapter`; "" = the base model)."""
    adapter: str = ""
    """With lora_each: the adapter its rows run under ("" = the base model)."""

    @property
    def key(self) -> str:
        """Stable identity of the shard: the same input and shard settings give the same keys (a
        lora.each unit's key adds its adapter's name, so an adapter added later gets new keys)."""
        lora = f"\0lora\0{self.adapter}" if self.lora_each else ""
        return hashlib.sha1(f"{self.name}\0{self.start}\0{self.stop}{lora}".encode()).hexdigest()[:20]

    def under_adapters(self, names: list[str]) -> list["Shard"]:
        """lora.each: one unit of this shard per adapter name ("" = the base model)."""
        return [replace(self, lora_each=True, adapter=n) for n in names]

    @classmethod
    def from_batch(cls, batch: dict) -> list["Shard"]:
        """Shards from a Ray Data batch of rows holding the Shard fields (numpy columns)."""
        def plain(value):
            return value.item() if hasattr(value, "item") else value

        names = [f.name for f in fields(cls)]
        return [cls(**{k: plain(batch[k][i]) for k in names}) for i in range(len(batch["file"]))]
