"""Structured outputs in a job spec: `sampling.structured_outputs` (vLLM's fields) and the shape
`label.json_schema` must have. Torch-free: the grammars themselves compile in preflight.

A JSON Schema is given inline (a mapping) or as the path or URL of a .json file. The driver reads
each file once (pipeline.io.schema_files) and puts its content in the spec, so that the workers
never read it again and the fingerprint hashes the schema, not where it was stored.
"""
from __future__ import annotations

import warnings
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from engine.api import KINDS, StructuredOutputsParams

SCHEMA_FILE_FIELDS = (("sampling", "structured_outputs", "json"), ("label", "json_schema"))
"""Spec keys whose string value names a JSON Schema file rather than holding the schema."""

with warnings.catch_warnings():  # `json` is vLLM's name; on a pydantic model it shadows BaseModel.json()
    warnings.filterwarnings("ignore", message='Field name "json"')

    class StructuredOutputsSpec(BaseModel):
        """Exactly one constraint on every row's generated text."""

        model_config = ConfigDict(extra="forbid")

        json: dict[str, Any] | bool | str | None = Field(
            None, description="A JSON Schema the output must satisfy: a mapping, or the path or URL of a .json "
            "file (local or any fsspec filesystem; relative to the spec file), read once by the driver.")
        regex: str | None = Field(None, description="A regular expression the whole output must match.")
        choice: list[str] | None = Field(None, description="The output is exactly one of these strings.")
        grammar: str | None = Field(None, description="An EBNF grammar (GBNF dialect, root rule `root`).")
        json_object: bool = Field(False, description="The output is any JSON object.")

        @model_validator(mode="after")
        def _one_constraint(self):
            try:
                self.params(placeholder=True)
            except ValueError as exc:
                raise PydanticCustomError("structured_outputs", str(exc).removeprefix("structured_outputs: ")
                                          .replace("structured_outputs.", "")) from None
            return self

        @property
        def schema_file(self) -> str | None:
            """The path or URL the schema is still to be read from, or None when it is inline."""
            return self.json if isinstance(self.json, str) else None

        def params(self, placeholder: bool = False) -> StructuredOutputsParams:
            """The engine's constraint. A schema still named by its file raises ValueError, unless
            `placeholder` (validation only: the file's content is checked once read)."""
            values = {k: getattr(self, k) for k in KINDS}
            if self.schema_file is not None:
                if not self.schema_file.strip():
                    raise ValueError("structured_outputs.json: an empty path")
                if not placeholder:
                    raise ValueError(f"structured_outputs.json: the schema file {self.schema_file} was not read "
                                     "(pipeline.io.read_schema_files reads it)")
                values["json"] = {}
            return StructuredOutputsParams(**values)


def check_label_schema(schema) -> None:
    """ValueError unless `schema` (label.json_schema, once read) describes an object with
    properties: their values become the label_fields struct's fields."""
    if isinstance(schema, str):
        if not schema.strip():
            raise ValueError("label.json_schema: an empty path")
        return  # a file: checked once the driver has read it
    if not isinstance(schema, dict) or not isinstance(schema.get("properties"), dict) or not schema["properties"]:
        raise ValueError("label.json_schema must describe an object with properties (type: object, properties: "
                         "{...}): its top-level properties become the label_fields columns")
    if schema.get("type", "object") != "object":
        raise ValueError(f"label.json_schema must have type object, got {schema.get('type')!r}")
    try:
        StructuredOutputsParams(json=schema)
    except ValueError as exc:
        raise ValueError(f"label.json_schema: {exc}") from None


def schema_file_refs(data: dict) -> list[tuple[tuple[str, ...], str]]:
    """(key path, path or URL) of every schema a spec dict names by file."""
    refs = []
    for path in SCHEMA_FILE_FIELDS:
        node = data
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, str):
            refs.append((path, node))
    return refs
