"""JSON Schemas a spec names by file (`sampling.structured_outputs.json`, `label.json_schema`):
read once, by the driver, into the spec itself. Its workers never read them again, and the job's
fingerprint hashes each schema's content, not the path it came from."""
from __future__ import annotations

import json
from typing import TypeVar

from pipeline.errors import SpecError
from pipeline.io.storage import Storage
from pipeline.spec import JobSpec, StageSpec, schema_file_refs, validate

S = TypeVar("S", bound=StageSpec)


def read_schema_files(spec: S) -> S:
    """`spec` (a job's or a processor's) with every schema file replaced by its content (`spec` itself
    when it names none). Files are local paths or URLs of any fsspec filesystem, opened with a job's
    input.storage_options.
    SpecError names the key and the cause when a file cannot be read or holds no JSON Schema."""
    data = spec.model_dump(mode="json")
    refs = schema_file_refs(data)
    if not refs:
        return spec
    options = spec.input.storage_options if isinstance(spec, JobSpec) else {}
    for path, url in refs:
        node = data
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = load_schema(url, options, ".".join(path))
    return validate(data, type(spec))


def load_schema(url: str, storage_options: dict, key: str) -> dict | bool:
    """The JSON Schema in the file at `url`; SpecError naming `key` if it cannot be had."""
    try:
        storage = Storage(url, storage_options)
        text = storage.read_text(storage.root)
    except FileNotFoundError:
        raise SpecError(f"{key}: schema file {url} not found") from None
    except (OSError, ValueError, ImportError) as exc:
        lines = str(exc).strip().splitlines()
        raise SpecError(f"{key}: cannot read schema file {url}: {type(exc).__name__}: "
                        f"{lines[0] if lines else ''}") from None
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise SpecError(f"{key}: {url} is not JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise SpecError(f"{key}: {url} must hold a JSON Schema (an object), got {type(schema).__name__}")
    return schema
