"""Reading one image from where a row says it is, as untrusted input: every source is bounded and
every refusal is one line (a ValueError) that fails that row alone.

- PIL images, bytes, `data:` URLs and Hugging Face datasets' {"bytes", "path"} structs always;
- local paths and `file://` only under `allowed_local_media_path` (unset: refused);
- `http(s)://` only to hosts in `allowed_media_domains` (empty: refused), with a timeout and a
  size bound;
- `s3://` and `gs://` through fsspec (the storage's own credentials).

An image's size is read from its header, before it is decoded: one over `max_image_pixels` is
refused without its pixels ever reaching memory (a decompression bomb stays a few bytes).
"""
from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

MAX_DOWNLOAD_BYTES = 64 * 2**20
"""Most bytes an image read from a URL or object storage may have."""
DOWNLOAD_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from, and how large they may be (EngineConfig's vLLM-named fields)."""

    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] = ()
    max_image_pixels: int = 36_000_000
    storage_options: dict = field(default_factory=dict)


def load_image(source, policy: MediaPolicy):
    """The image `source` names, decoded to RGB (a PIL image); ValueError in one line otherwise."""
    from PIL import Image

    if isinstance(source, Image.Image):
        check_pixels(source.size, policy, "the image")
        return source.convert("RGB")
    if isinstance(source, dict) and ("bytes" in source or "path" in source):  # Hugging Face datasets' struct
        if source.get("bytes") is not None:
            return decode(source["bytes"], policy, "the image's bytes")
        source = source.get("path")
    if isinstance(source, (bytes, bytearray, memoryview)):
        return decode(bytes(source), policy, "the image's bytes")
    if not isinstance(source, str) or not source:
        raise ValueError(f"an image must be a PIL image, bytes, a data: URL, a URL or a path, not "
                         f"{type(source).__name__}")
    if source.startswith("data:"):
        return decode(data_url_bytes(source), policy, "the data: URL")
    scheme = urllib.parse.urlsplit(source).scheme.lower()
    if scheme in ("http", "https"):
        return decode(download(source, policy), policy, source)
    if scheme in ("s3", "gs", "gcs"):
        return decode(read_storage(source, policy), policy, source)
    if scheme in ("", "file"):
        return decode(read_local(source, policy), policy, source)
    raise ValueError(f"{shown(source)}: images are read from data:, http(s)://, s3://, gs:// URLs or local paths, "
                     f"not {scheme}://")


def shown(source: str) -> str:
    return source if len(source) <= 80 else source[:77] + "..."


def check_pixels(size: tuple[int, int], policy: MediaPolicy, what: str) -> None:
    width, height = size
    if width * height > policy.max_image_pixels:
        raise ValueError(f"{what} has {width}x{height} = {width * height:,} pixels, over engine.max_image_pixels "
                         f"({policy.max_image_pixels:,})")
    if width < 1 or height < 1:
        raise ValueError(f"{what} is empty ({width}x{height})")


def decode(data: bytes, policy: MediaPolicy, what: str):
    """Bytes -> an RGB PIL image, its size checked from the header before any pixel is decoded."""
    import warnings

    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))  # reads the header only
            check_pixels(image.size, policy, what if len(what) <= 80 else shown(what))
            image.load()
            return image.convert("RGB")
    except UnidentifiedImageError:
        raise ValueError(f"{shown(what)} is not an image PIL can read ({len(data):,} bytes)") from None
    except (OSError, SyntaxError, Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ValueError(f"{shown(what)} does not decode: {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''}") from None


def data_url_bytes(url: str) -> bytes:
    head, _, payload = url.partition(",")
    if not head.startswith("data:image/"):
        raise ValueError(f"{shown(url)}: a data: URL of an image starts data:image/...")
    if not head.endswith(";base64"):
        return urllib.parse.unquote_to_bytes(payload)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{shown(url)}: its base64 payload does not decode") from None


def download(url: str, policy: MediaPolicy) -> bytes:
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    allowed = [d.lower() for d in policy.allowed_media_domains]
    if host not in allowed:
        where = f"engine.allowed_media_domains ({', '.join(allowed)})" if allowed else \
            "engine.allowed_media_domains, which is empty"
        raise ValueError(f"{shown(url)}: host {host!r} is not in {where}")
    try:
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:  # noqa: S310  host allowed above
            data = response.read(MAX_DOWNLOAD_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"{shown(url)} cannot be read: {type(exc).__name__}: {exc}") from None
    return bounded(data, url)


def bounded(data: bytes, where: str) -> bytes:
    if len(data) > MAX_DOWNLOAD_BYTES:
        raise ValueError(f"{shown(where)} is over {MAX_DOWNLOAD_BYTES // 2**20} MiB")
    return data


def read_storage(url: str, policy: MediaPolicy) -> bytes:
    import fsspec

    try:
        with fsspec.open(url, "rb", **policy.storage_options) as f:
            return bounded(f.read(MAX_DOWNLOAD_BYTES + 1), url)
    except (OSError, ValueError, ImportError) as exc:
        raise ValueError(f"{shown(url)} cannot be read: {type(exc).__name__}: {exc}") from None


def read_local(source: str, policy: MediaPolicy) -> bytes:
    path = Path(urllib.parse.urlsplit(source).path if source.startswith("file:") else source)
    if policy.allowed_local_media_path is None:
        raise ValueError(f"{shown(source)}: local image paths are refused unless engine.allowed_local_media_path "
                         "names a directory they are under")
    root = Path(os.path.realpath(policy.allowed_local_media_path))
    real = Path(os.path.realpath(path))
    if root != real and root not in real.parents:
        raise ValueError(f"{shown(source)} is outside engine.allowed_local_media_path ({root})")
    try:
        with open(real, "rb") as f:
            return bounded(f.read(MAX_DOWNLOAD_BYTES + 1), source)
    except OSError as exc:
        raise ValueError(f"{shown(source)} cannot be read: {type(exc).__name__}: {exc.strerror or exc}") from None
