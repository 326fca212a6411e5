"""The row record: one input row as it goes from reading to writing (pipeline.io reads it, a task of
pipeline.tasks turns it into a result, the output table and OpenAI Batch lines write it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Row:
    """One input row. Tasks read it and never change it: what they make of it is a RowResult."""

    id: str
    """The row's id: its id column's value, an OpenAI Batch line's custom_id, else file:line (or a hash
    of the prompt in a processor)."""
    values: dict[str, Any] = field(default_factory=dict)
    """The input row's columns (an OpenAI Batch line's fields); {} for a line that did not parse."""
    error: str | None = None
    """Why the row cannot run, found before any task: a line that did not parse, a missing id."""

    @classmethod
    def batch(cls, values: list[dict], ids: list[str], errors: list[str | None] | None = None) -> list[Row]:
        """Rows from parallel lists (errors None: none failed)."""
        return [cls(i, v, e) for v, i, e in zip(values, ids, errors or [None] * len(values))]

    def get(self, column: str, default=None):
        """The value of input column `column`."""
        return self.values.get(column, default)

    def failing(self, error: str) -> Row:
        """This row with an error found before its task (a later problem keeps the first)."""
        return self if self.error is not None else Row(self.id, self.values, error)
