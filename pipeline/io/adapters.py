"""LoRA adapters a job names: `lora.path` listed once (its subfolders holding adapter_config.json,
each named by its folder), merged with `lora.adapters` (which wins on a shared name)."""
from __future__ import annotations

import posixpath

from pipeline.errors import InputError
from pipeline.io.storage import Storage

CONFIG = "adapter_config.json"


def list_adapters(path: str | None, adapters: dict[str, str], storage_options: dict | None = None) -> dict[str, str]:
    """name -> path of every adapter: those under `path` (a folder of adapter folders), then `adapters`."""
    found: dict[str, str] = {}
    if path:
        storage = Storage(path, storage_options or {})
        fs, root = storage.fs, storage.root.rstrip("/")
        try:
            entries = fs.ls(root, detail=True)
        except (OSError, ValueError) as exc:
            raise InputError(f"lora.path {path}: cannot list it: {exc}") from None
        for entry in sorted(entries, key=lambda e: e["name"]):
            name = posixpath.basename(entry["name"].rstrip("/"))
            if entry.get("type") != "directory" or name.startswith((".", "_")):
                continue
            if fs.exists(posixpath.join(entry["name"], CONFIG)):
                found[name] = storage.url.rstrip("/") + "/" + name
        if not found:
            raise InputError(f"lora.path {path}: no adapter folders (subfolders holding {CONFIG})")
    return {**found, **adapters}
