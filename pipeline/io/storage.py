"""Paths on any fsspec filesystem, with atomic writes: an object is either whole or absent."""
from __future__ import annotations

import logging
import os
import posixpath
import random
import time
import uuid
from dataclasses import dataclass, field

import fsspec

log = logging.getLogger(__name__)

SECRET_KEYS = ("key", "secret", "token", "password", "credential", "session")


@dataclass
class Storage:
    """A directory-like root on a filesystem (local, s3://, gs://, ...)."""

    url: str
    """The root as the user wrote it."""
    options: dict = field(default_factory=dict)
    """fsspec storage options (endpoint_url, key, ...)."""

    def __post_init__(self) -> None:
        self.fs, root = fsspec.core.url_to_fs(self.url, **_fs_options(self.url, self.options))
        self.root = root.rstrip("/") or "/"
        self.is_local = "file" in _protocols(self.fs) or "local" in _protocols(self.fs)

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def uri(self, path: str) -> str:
        """A full URL for a path on this filesystem (for manifests and messages)."""
        return path if self.is_local else self.fs.unstrip_protocol(path)

    def exists(self, path: str) -> bool:
        return self.fs.exists(path)

    def read_bytes(self, path: str) -> bytes:
        return self.fs.cat_file(path)

    def read_text(self, path: str) -> str:
        return self.read_bytes(path).decode("utf-8")

    def write_atomic(self, path: str, data: bytes) -> None:
        """Writes `data` so that readers see the old object, or the whole new one, never a part."""
        if self.is_local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = os.path.join(os.path.dirname(path), f".tmp-{uuid.uuid4().hex}-{os.path.basename(path)}")
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        else:
            # Object stores publish an object only when its (single or multipart) upload completes.
            self.fs.pipe_file(path, data)

    def list(self, path: str) -> list[str]:
        """File paths directly under `path` (empty if it does not exist)."""
        try:
            entries = self.fs.ls(path, detail=True, refresh=True) if not self.is_local else \
                self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return []
        return sorted(e["name"] for e in entries if e.get("type") != "directory")

    def remove_tree(self, path: str) -> None:
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def remove_temporaries(self, path: str) -> int:
        """Deletes half-written local files left by a crash (object stores never show them)."""
        if not self.is_local:
            return 0
        stale = [p for p in self.list(path) if posixpath.basename(p).startswith(".tmp-")]
        for p in stale:
            self.fs.rm(p)
        return len(stale)


def with_retries(fn, what: str, attempts: int = 5, first_delay: float = 0.5):
    """Calls fn(); on OSError (throttling, 5xx, short reads, dropped connections) retries with
    exponential backoff and jitter, then re-raises naming `what`."""
    delay = first_delay
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except FileNotFoundError:
            raise
        except OSError as exc:
            if attempt == attempts:
                raise OSError(f"{what} failed after {attempts} attempts: {exc}") from exc
            log.warning("%s failed (attempt %d of %d), retrying in %.1fs: %s", what, attempt, attempts, delay, exc)
            time.sleep(delay * (0.5 + random.random()))
            delay *= 2


def _protocols(fs) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


def _fs_options(url: str, options: dict) -> dict:
    opts = dict(options)
    if url.startswith(("s3://", "s3a://")):
        # s3fs takes the endpoint under client_kwargs; accept the short spelling too.
        endpoint = opts.pop("endpoint_url", None) or os.environ.get("AWS_ENDPOINT_URL_S3") \
            or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            opts.setdefault("client_kwargs", {})["endpoint_url"] = endpoint
    return opts


def secret_values(*option_sets: dict) -> list[str]:
    """Secret-looking values of storage options and of the AWS environment, to scrub from text."""
    found = [v for k, v in os.environ.items() if k.startswith("AWS_") and any(s in k.lower() for s in SECRET_KEYS)]

    def walk(opts):
        for k, v in opts.items():
            if isinstance(v, dict):
                walk(v)
            elif isinstance(v, str) and any(s in str(k).lower() for s in SECRET_KEYS):
                found.append(v)

    for opts in option_sets:
        walk(opts or {})
    return sorted({v for v in found if len(v) >= 4}, key=len, reverse=True)


def scrub(text: str, secrets: list[str]) -> str:
    for value in secrets:
        text = text.replace(value, "***")
    return text


def redact_spec(spec: dict) -> dict:
    """A job spec (as JSON) with the secrets of its storage options hidden and nothing else
    touched: `max_tokens` or `stop_token_ids` are no secrets, whatever their names say."""
    out = dict(spec)
    for section in ("input", "output"):
        if isinstance(out.get(section), dict) and "storage_options" in out[section]:
            out[section] = {**out[section], "storage_options": redact(out[section]["storage_options"])}
    return out


def redact(value):
    """A copy of `value` with secret-looking option values replaced by '***'."""
    if isinstance(value, dict):
        return {k: "***" if any(s in str(k).lower() for s in SECRET_KEYS) and v else redact(v)
                for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value
