"""The input files an output was started with, kept in its _job.json: a resume whose input files
changed is refused, since the parts committed from them cover their rows as they were (a file that
grew would otherwise be cut into new shards beside its committed ones, and data/ would hold those
rows twice). Files added since are new shards and resume; a file is compared by its size and, on
object storage, its ETag."""
from __future__ import annotations

import hashlib

NAMED_FILES = 10_000
"""Up to this many files, each one's size is kept, so that a refusal can name the file that changed
(and a file added is told apart from a file changed); past it, only their digest."""


def input_record(files) -> dict:
    """{"files": how many, "digest": of every (name, size, ETag), "sizes": {name: [size, ETag]}}."""
    sizes = getattr(files, "sizes", None) or [None] * len(files)
    tags = getattr(files, "tags", None) or [None] * len(files)
    entries = sorted((name, size, tag) for (_, name, _), size, tag in zip(files, sizes, tags))
    digest = hashlib.sha256("".join(f"{n}\0{s}\0{t}\n" for n, s, t in entries).encode()).hexdigest()[:32]
    record = {"files": len(entries), "digest": digest}
    if len(entries) <= NAMED_FILES:
        record["sizes"] = {name: [size, tag] for name, size, tag in entries}
    return record


def input_conflict(path: str, was: dict | None, now: dict) -> str | None:
    """Why an output started on the input files `was` cannot resume on `now` (None: it can)."""
    if was is None or was.get("digest") == now.get("digest"):
        return None
    how = "write to a new output.path, or use --overwrite to start afresh"
    then, current = was.get("sizes"), now.get("sizes")
    if then is None or current is None:
        return (f"{path}: the input's files changed since this output was started ({was.get('files'):,} files "
                f"then, {now.get('files'):,} now, too many to name each): {how}")
    for name, (size, tag) in sorted(then.items()):
        if name not in current:
            return (f"{path}: input file {name} is gone since this output was started, and its committed parts "
                    f"hold its rows: put it back, or {how}")
        if current[name] != [size, tag]:
            sizes = f"{size:,} bytes then, {current[name][0]:,} now" if size is not None and current[name][0] \
                is not None else "its ETag differs"
            return f"{path}: input file {name} changed since this output was started ({sizes}): {how}"
    return None  # only files added: their rows are new shards
