"""Reading one image from where a row says it is, as untrusted input: every source is bounded and
every refusal is one line (a ValueError) that fails that row alone.

- PIL images, bytes, `data:` URLs and Hugging Face datasets' {"bytes", "path"} structs always;
- local paths and `file://` only under `allowed_local_media_path` (unset: refused);
- `http(s)://` only to hosts in `allowed_media_domains` (empty: refused), each redirect's target
  held to the same list, the whole download within DOWNLOAD_TIMEOUT_S and MAX_DOWNLOAD_BYTES;
- `s3://` and `gs://` only under a bucket or prefix in `allowed_media_buckets` (empty: refused), read
  with the worker's own credentials.

An image's size is read from its header, before it is decoded: one over `max_image_pixels` is
refused without its pixels ever reaching memory (a decompression bomb stays a few bytes); only the
formats in IMAGE_FORMATS are opened, and any failure to decode one fails its row.
"""
from __future__ import annotations

import base64
import binascii
import contextlib
import http.client
import io
import os
import ssl
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

MAX_DOWNLOAD_BYTES = 64 * 2**20
"""Most bytes an image read from a URL or object storage may have."""
DOWNLOAD_TIMEOUT_S = 15.0
"""The deadline of one image's download over http(s), redirects and every byte included."""
MAX_REDIRECTS = 5
"""Most redirects one image's download follows."""
DOWNLOAD_ATTEMPTS = 3
"""Tries of a download whose failure may pass, within its deadline."""
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
"""The formats images are opened in (Pillow's names); any other is refused before it is decoded."""
STORAGE_SCHEMES = {"s3": "s3", "s3a": "s3", "gs": "gs", "gcs": "gs"}
"""Object-storage URL schemes -> the one allowed_media_buckets entries are compared under."""


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from, and how large they may be (EngineConfig's vLLM-named fields)."""

    allowed_local_media_path: str | None = None
    allowed_media_domains: tuple[str, ...] = ()
    max_image_pixels: int = 36_000_000
    storage_options: dict = field(default_factory=dict)
    allowed_media_buckets: tuple[str, ...] = ()
    """Object-storage prefixes images may be read under: "s3://bucket" or "s3://bucket/some/prefix"."""
    max_image_aspect_ratio: float = 200.0
    """The longer edge over the shorter at most (Qwen2-VL's own bound)."""


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
    if scheme in STORAGE_SCHEMES:
        return decode(read_storage(source, policy), policy, source)
    if scheme in ("", "file"):
        return decode(read_local(source, policy), policy, source)
    raise ValueError(f"{shown(source)}: images are read from data:, http(s)://, s3://, gs:// URLs or local paths, "
                     f"not {scheme}://")


def shown(source: str) -> str:
    return source if len(source) <= 80 else source[:77] + "..."


def check_pixels(size: tuple[int, int], policy: MediaPolicy, what: str) -> None:
    """An image's size against the policy, before its pixels are decoded. The aspect ratio bounds what
    a processor makes of it: one that scales the short edge up (LLaVA-1.5's to 336) turns a 1x400
    image into a 336x134,400 one."""
    width, height = size
    if width < 1 or height < 1:
        raise ValueError(f"{what} is empty ({width}x{height})")
    if width * height > policy.max_image_pixels:
        raise ValueError(f"{what} has {width}x{height} = {width * height:,} pixels, over engine.max_image_pixels "
                         f"({policy.max_image_pixels:,})")
    ratio = max(width, height) / min(width, height)
    if ratio > policy.max_image_aspect_ratio:
        raise ValueError(f"{what} is {width}x{height}, an aspect ratio of {ratio:,.0f}, over "
                         f"engine.max_image_aspect_ratio ({policy.max_image_aspect_ratio:g})")


def decode(data: bytes, policy: MediaPolicy, what: str):
    """Bytes -> an RGB PIL image, its size checked from the header before any pixel is decoded.
    Only IMAGE_FORMATS are opened, and whatever decoding raises becomes this row's ValueError."""
    from PIL import Image

    with decoding(shown(what), len(data)):
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)  # reads the header only
    check_pixels(image.size, policy, shown(what))
    with decoding(shown(what), len(data)):
        image.load()
        return image.convert("RGB")


@contextlib.contextmanager
def decoding(what: str, size: int):
    """Any failure of Pillow's inside the block -> ValueError in one line naming the image."""
    import warnings

    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            yield
    except UnidentifiedImageError:
        raise ValueError(f"{what} is not an image in a format images are read in "
                         f"({', '.join(IMAGE_FORMATS)}; {size:,} bytes)") from None
    except MemoryError:
        raise ValueError(f"{what} does not decode within memory ({size:,} bytes)") from None
    except Exception as exc:  # noqa: BLE001  a plugin's NotImplementedError, struct.error, ... all fail the row
        raise ValueError(f"{what} does not decode: {type(exc).__name__}: {first_line(exc)}") from None


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


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


def check_host(url: str, policy: MediaPolicy, first: str) -> urllib.parse.SplitResult:
    """`url` (the first URL or a redirect's target) held to the policy: http(s) to an allowed host."""
    parts = urllib.parse.urlsplit(url)
    what = shown(first) if url == first else f"{shown(first)} redirects to {shown(url)}, whose"
    if parts.scheme.lower() not in ("http", "https"):
        raise ValueError(f"{what} scheme {parts.scheme!r} is not http(s)")
    host = (parts.hostname or "").lower()
    allowed = [d.lower() for d in policy.allowed_media_domains]
    if host not in allowed:
        where = f"engine.allowed_media_domains ({', '.join(allowed)})" if allowed else \
            "engine.allowed_media_domains, which is empty"
        raise ValueError(f"{what}{':' if url == first else ''} host {host!r} is not in {where}")
    return parts


def download(url: str, policy: MediaPolicy) -> bytes:
    """The bytes at `url`, each redirect checked against the policy before it is followed, the whole
    of it (connections, redirects, retries, every byte) within DOWNLOAD_TIMEOUT_S. A failure that may
    pass (a refused or dropped connection, HTTP 408, 429 or 5xx) is tried again, up to
    DOWNLOAD_ATTEMPTS times, before it becomes the row's error."""
    deadline = time.monotonic() + DOWNLOAD_TIMEOUT_S
    delay = 0.25
    for attempt in range(1, DOWNLOAD_ATTEMPTS + 1):
        data, passing = download_once(url, policy, deadline)
        if passing is None:
            return data
        if attempt == DOWNLOAD_ATTEMPTS or time.monotonic() + delay >= deadline:
            raise ValueError(f"{shown(url)} cannot be read ({attempt} attempt{'s' if attempt > 1 else ''}): "
                             f"{passing}")
        time.sleep(delay)
        delay *= 2
    raise AssertionError("not reached")


def download_once(url: str, policy: MediaPolicy, deadline: float) -> tuple[bytes, str | None]:
    """(the bytes, None), or (b"", why) for a failure that may pass; ValueError for one that won't."""
    current = url
    for _ in range(MAX_REDIRECTS + 1):
        parts = check_host(current, policy, url)
        try:
            status, location, data = fetch(parts, deadline)
        except TimeoutError:
            raise ValueError(f"{shown(url)} was not read within {DOWNLOAD_TIMEOUT_S:g} s") from None
        except (OSError, http.client.HTTPException) as exc:
            if isinstance(exc, ssl.SSLCertVerificationError):
                raise ValueError(f"{shown(url)} cannot be read: {type(exc).__name__}: {first_line(exc)}") from None
            return b"", f"{type(exc).__name__}: {first_line(exc)}"
        if status in (301, 302, 303, 307, 308) and location:
            current = urllib.parse.urljoin(current, location)
            continue
        if status in (408, 429) or status >= 500:
            return b"", f"HTTP {status}"
        if status != 200:
            raise ValueError(f"{shown(url)} cannot be read: HTTP {status}")
        return bounded(data, url), None
    raise ValueError(f"{shown(url)} redirects more than {MAX_REDIRECTS} times")


def fetch(parts: urllib.parse.SplitResult, deadline: float) -> tuple[int, str | None, bytes]:
    """One GET: (status, Location, body up to MAX_DOWNLOAD_BYTES + 1); TimeoutError past `deadline`."""
    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        return remaining

    secure = parts.scheme.lower() == "https"
    connection = (http.client.HTTPSConnection(parts.hostname, parts.port, timeout=left(),
                                              context=ssl.create_default_context()) if secure
                  else http.client.HTTPConnection(parts.hostname, parts.port, timeout=left()))
    try:
        path = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
        connection.request("GET", path, headers={"User-Agent": "batchinfer", "Accept": "image/*"})
        sock = connection.sock  # the response keeps reading from it once the connection lets it go
        sock.settimeout(left())
        response = connection.getresponse()
        if response.status != 200:
            return response.status, response.getheader("Location"), b""
        chunks, size = [], 0
        while size <= MAX_DOWNLOAD_BYTES:
            sock.settimeout(left())
            chunk = response.read1(min(2**16, MAX_DOWNLOAD_BYTES + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return 200, None, b"".join(chunks)
    except (TimeoutError, ssl.SSLError) as exc:
        if isinstance(exc, ssl.SSLError) and "timed out" not in str(exc):
            raise
        raise TimeoutError from None
    finally:
        connection.close()


def bounded(data: bytes, where: str) -> bytes:
    if len(data) > MAX_DOWNLOAD_BYTES:
        raise ValueError(f"{shown(where)} is over {MAX_DOWNLOAD_BYTES // 2**20} MiB")
    return data


def storage_allowed(url: str, policy: MediaPolicy) -> bool:
    """Whether an object-storage URL is under an allowed_media_buckets entry (a bucket, or a prefix
    that ends at a '/' of the key)."""
    parts = urllib.parse.urlsplit(url)
    scheme, bucket, key = STORAGE_SCHEMES.get(parts.scheme.lower()), parts.netloc, parts.path.lstrip("/")
    for entry in policy.allowed_media_buckets:
        allowed = urllib.parse.urlsplit(entry if "://" in entry else f"{parts.scheme}://{entry}")
        prefix = allowed.path.strip("/")
        if (STORAGE_SCHEMES.get(allowed.scheme.lower()) == scheme and allowed.netloc == bucket
                and (not prefix or key == prefix or key.startswith(prefix + "/"))):
            return True
    return False


def read_storage(url: str, policy: MediaPolicy) -> bytes:
    import fsspec

    if not storage_allowed(url, policy):
        allowed = policy.allowed_media_buckets
        where = f"engine.allowed_media_buckets ({', '.join(allowed)})" if allowed else \
            "engine.allowed_media_buckets, which is empty"
        raise ValueError(f"{shown(url)} is not under {where}")
    delay = 0.25
    for attempt in range(1, DOWNLOAD_ATTEMPTS + 1):
        try:
            with fsspec.open(url, "rb", **policy.storage_options) as f:
                data = f.read(MAX_DOWNLOAD_BYTES + 1)
        except (FileNotFoundError, PermissionError, ValueError, ImportError) as exc:  # these do not pass
            raise ValueError(f"{shown(url)} cannot be read: {type(exc).__name__}: {first_line(exc)}") from None
        except OSError as exc:  # throttled, a dropped connection: tried again
            if attempt == DOWNLOAD_ATTEMPTS:
                raise ValueError(f"{shown(url)} cannot be read ({attempt} attempts): {type(exc).__name__}: "
                                 f"{first_line(exc)}") from None
            time.sleep(delay)
            delay *= 2
        else:
            return bounded(data, url)
    raise AssertionError("not reached")


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
