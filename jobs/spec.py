"""Loading a job spec: a YAML file, `--set a.b=value` overrides and shortcut flags, validated once
against the schema in pipeline.spec (whose names are re-exported here). JSON Schema files the spec
names are read here, once: a relative path in the YAML file is relative to that file (one given
with --set, to the working directory)."""
from __future__ import annotations

import os
from pathlib import Path

import yaml

from pipeline.io import read_schema_files
from pipeline.spec import JobSpec, SpecError, field_reference, schema_file_refs, validate  # noqa: F401  (re-exported)


def load_spec(path: str | Path | None = None, overrides: list[str] | None = None,
              **shortcuts: str | None) -> JobSpec:
    """Reads a YAML spec (or none), applies `a.b=value` overrides and shortcut flags, validates once."""
    data: dict = {}
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as exc:
            raise SpecError(f"cannot read spec {path}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise SpecError(f"{path} is not valid YAML: {str(exc).splitlines()[0]}") from exc
        if not isinstance(data, dict):
            raise SpecError(f"{path}: a job spec is a YAML mapping, got {type(data).__name__}")
        relative_to(data, Path(path).parent)
    for item in overrides or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SpecError(f"--set expects key=value, got {item!r}")
        set_path(data, key.strip(), yaml.safe_load(raw) if raw.strip() else "")
    for key, value in shortcuts.items():
        if value is not None:
            set_path(data, {"input": "input.path", "output": "output.path"}.get(key, key), value)
    return read_schema_files(validate(data))


def relative_to(data: dict, base: Path) -> None:
    """Schema file paths of a spec file, made relative to its directory (URLs are left as they are)."""
    for keys, value in schema_file_refs(data):
        if "://" in value or os.path.isabs(value) or not value.strip():
            continue
        node = data
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = str(base / value)


def set_path(data: dict, dotted: str, value) -> None:
    node = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise SpecError(f"--set {dotted}: {part} is not a section")
    node[parts[-1]] = value
