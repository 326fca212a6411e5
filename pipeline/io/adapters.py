"""LoRA adapters a job names: `lora.path` listed once (its subfolders holding adapter_config.json,
each named by its folder), merged with `lora.adapters` (which wins on a shared name). A local
`lora.path` is a folder of folders the job trusts, nothing more: a subfolder or adapter file that
is a link leading out of it is refused, so no file outside the job's paths is read."""
from __future__ import annotations

import os
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
            linked = storage.is_local and entry.get("islink") and os.path.isdir(entry["name"])
            if (entry.get("type") != "directory" and not linked) or name.startswith((".", "_")):
                continue
            if fs.exists(posixpath.join(entry["name"], CONFIG)):
                if storage.is_local:
                    _inside(path, root, entry["name"])
                found[name] = storage.url.rstrip("/") + "/" + name
        if not found:
            raise InputError(f"lora.path {path}: no adapter folders (subfolders holding {CONFIG})")
    return {**found, **adapters}


def _inside(path: str, root: str, folder: str) -> None:
    """InputError when the adapter `folder` under `root`, or a file in it, resolves (through links)
    to a place outside `root`."""
    top = os.path.realpath(root)
    for item in [folder] + [os.path.join(folder, n) for n in sorted(os.listdir(folder))]:
        real = os.path.realpath(item)
        if os.path.commonpath([top, real]) != top:
            raise InputError(f"lora.path {path}: {os.path.relpath(item, root)} leads outside it (to {real}); "
                             "an adapter's folder and files must lie inside lora.path")
