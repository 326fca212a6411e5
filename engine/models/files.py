"""Model directories from the outside world: a builtin, a local directory, a copy of an
object-storage URL or a Hugging Face Hub snapshot (engine.models.hub); their weights checked,
their config and tokenizer read."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from engine.api.config import EngineConfig, auto_dtype
from engine.api.errors import ModelLoadError, one_line
from engine.models import gguf, hub
from engine.models.builtin import (BUILTIN_PREFIX, REAL_MODELS, builtin_path, default_cache_dir, is_builtin,
                                   real_model_file)
from engine.models.gguf import is_gguf_file

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def resolve_model_dir(config: EngineConfig, which: str | None = None, weights: bool = True) -> Path:
    """Local directory holding `which` (default: config.model): a builtin, a local directory, a
    copy of an object-storage URL, a Hugging Face Hub snapshot, or the safetensors directory a
    GGUF file converts to (engine.models.gguf). An existing local path wins over a Hub id of the
    same shape. weights=False fetches only config and tokenizer files of a Hub model, and reads
    only a GGUF file's header (the other kinds are resolved whole)."""
    ref = which or config.model
    cache = Path(config.cache_dir) if config.cache_dir else default_cache_dir()
    main = which is None or which == config.model
    gguf_file = config.gguf_file if main else None
    if is_builtin(ref):
        if ref[len(BUILTIN_PREFIX):] in REAL_MODELS:
            path, digest = real_model_file(ref)
            return _from_gguf(config, path, cache, weights, main, digest) if path.suffix == ".gguf" else path
        return builtin_path(ref, config.cache_dir)
    if ref.startswith("file://"):
        ref = ref[len("file://"):]
    if "://" in ref:
        if is_gguf_file(ref):
            return _from_gguf(config, copy_remote_file(ref, cache), cache, weights, main)
        path = copy_remote(ref, cache)
        return _from_gguf(config, path / gguf_file, cache, weights, main) if gguf_file else path
    path = Path(ref).expanduser()
    repo, _, tag = ref.partition(":")
    if not path.exists() and tag and is_hub_model(repo):
        return _from_gguf(config, hub.gguf_path(repo, tag, config.revision if main else None), cache, weights, main)
    if is_hub_model(ref):
        revision = config.revision if main else None
        if gguf_file:
            return _from_gguf(config, hub.gguf_path(ref, gguf_file, revision), cache, weights, main)
        return hub.resolve(ref, revision, weights=weights, allow_pickle=config.allow_pickle,
                           trust_remote_code=config.trust_remote_code)
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(config, path, cache, weights, main)
    if not path.is_dir():
        raise ModelLoadError(f"model directory not found: {ref}")
    if gguf_file:
        return _from_gguf(config, path / gguf_file, cache, weights, main)
    if not (path / "config.json").exists():
        found = sorted(path.glob("*.gguf"))
        if len(found) == 1:
            return _from_gguf(config, found[0], cache, weights, main)
        if found:
            raise ModelLoadError(f"{ref} holds {len(found)} GGUF files ({', '.join(p.name for p in found[:4])}): "
                                 "name one with engine.gguf_file")
        raise ModelLoadError(f"{ref} is not a Hugging Face model directory (no config.json)")
    return path


def storage_dtype(config: EngineConfig) -> str:
    """The dtype a GGUF file is converted to: the engine's, with `auto` resolved as the device
    will resolve it (float32 on CPU, bfloat16 on CUDA)."""
    if config.dtype != "auto":
        return config.dtype
    if config.device == "cpu" or config.device == "mps":
        return "float32"
    if config.device == "auto":
        import torch

        return auto_dtype("cuda" if torch.cuda.is_available() else "cpu")
    return auto_dtype("cuda")


def _from_gguf(config: EngineConfig, path: Path, cache: Path, weights: bool, main: bool,
               digest: str | None = None) -> Path:
    """The directory converted from the GGUF file `path` (its header alone with weights=False)."""
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    header = None
    if main and config.tokenizer is None:
        header = gguf.read_header(path)
        if not header.has_tokenizer:
            raise ModelLoadError(f"{path}: the GGUF metadata holds no tokenizer; name one with engine.tokenizer")
    return gguf.converted_dir(path, cache, storage_dtype(config), weights=weights, digest=digest, header=header)


def is_hub_model(ref: str) -> bool:
    """A Hugging Face Hub id: `org/name` shaped, not a builtin, a URL or an existing local path."""
    return not is_builtin(ref) and "://" not in ref and not Path(ref).expanduser().exists() and hub.is_hub_id(ref)


def check_model_files(config: EngineConfig) -> Path:
    """Resolves config.model and checks its weights without fetching a Hub model's weights (the
    Hub's file list is checked instead). Returns the directory holding config and tokenizer."""
    path = resolve_model_dir(config, weights=False)
    if gguf.converted_from(path) is not None:
        return path  # the GGUF header was read: its architecture, tensor types and tokenizer checked
    names = hub.list_files(config.model, config.revision, path) if is_hub_model(config.model) else None
    check_weights(path, config.allow_pickle, names)
    return path


def copy_remote(url: str, cache_dir: Path) -> Path:
    """A local copy of every file under an object-storage URL, made once per cache: under a file
    lock per entry (actors on one node copy it once), into a temporary directory whose files are
    each checked against the listing's size (and MD5 ETag where the store gives one), renamed into
    place when whole. A listed name that would land outside the copy is refused in one line."""
    import fsspec

    key = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    target = cache_dir / "models" / key
    marker = target / ".complete"
    try:
        fs, root = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as exc:
        raise ModelLoadError(f"cannot open {url}: {exc}") from exc
    root = root.rstrip("/")
    if marker.exists() and copied_as_listed(marker, fs, root):
        return target
    with cache_entry(target) as tmp:
        if marker.exists() and copied_as_listed(marker, fs, root):
            return target  # another process copied it while this one waited
        try:
            listing = {f: info for f, info in fs.find(root, detail=True).items() if not f.endswith("/")}
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot list {url}: {one_line(exc)}") from exc
        if not listing:
            raise ModelLoadError(f"no files under {url}")
        # every name checked before any byte is written
        plan = [(remote, inside(tmp, under(remote, root), url, remote), info) for remote, info in sorted(listing.items())]
        for remote, local, info in plan:
            local.parent.mkdir(parents=True, exist_ok=True)
            fetch_checked(fs, remote, local, info, url)
        (tmp / ".complete").write_text(json.dumps({"url": url, "files": {
            under(remote, root): {"size": info.get("size"), "etag": etag(info)} for remote, _, info in plan}}, indent=1))
    return target


def copy_remote_file(url: str, cache_dir: Path) -> Path:
    """A local copy of the single object-storage file at `url` (a .gguf), made once, as copy_remote
    makes a directory's."""
    import fsspec

    name = url.rstrip("/").rsplit("/", 1)[-1]
    entry = cache_dir / "models" / hashlib.sha256(url.encode()).hexdigest()[:16]
    if (entry / ".complete").exists():
        return inside(entry, name, url, url)
    try:
        fs, remote = fsspec.core.url_to_fs(url)
        info = fs.info(remote)
    except (ImportError, ValueError, OSError) as exc:
        raise ModelLoadError(f"cannot copy {url}: {one_line(exc)}") from exc
    with cache_entry(entry) as tmp:
        if (entry / ".complete").exists():
            return inside(entry, name, url, url)
        fetch_checked(fs, remote, inside(tmp, name, url, url), info, url)
        (tmp / ".complete").write_text(json.dumps({"url": url, "files": {
            name: {"size": info.get("size"), "etag": etag(info)}}}, indent=1))
    return inside(entry, name, url, url)


def copied_as_listed(marker: Path, fs, root: str) -> bool:
    """Whether the copy `marker` completed still matches the store's listing (every object's name,
    size and ETag): objects changed under the same URL are copied anew, so every node runs the
    same files. A store that cannot be listed now keeps the copy."""
    try:
        files = json.loads(marker.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False  # a copy of an earlier version, which kept no listing: copied once more
    try:
        fs.invalidate_cache(root)  # s3fs keeps listings it made: this one must be the store's own
        listing = {f: info for f, info in fs.find(root, detail=True).items() if not f.endswith("/")}
    except (OSError, ValueError):
        return True
    now = {under(remote, root): {"size": info.get("size"), "etag": etag(info)} for remote, info in listing.items()}
    return not now or now == files  # objects removed since: the copy is all there is of them


def under(remote: str, root: str) -> str:
    """A listed key's name below the listing's root, as the store spells it (never normalized: a key
    'llm/x/../config.json' keeps its '..', which `inside` then refuses)."""
    return remote[len(root) + 1:] if remote.startswith(root + "/") else remote


def inside(directory: Path, name: str, url: str, key: str) -> Path:
    """directory / name, where a listed name may only name a file inside `directory`: '..', an
    absolute path or an empty name is refused (ModelLoadError) in one line naming the key."""
    parts = name.replace("\\", "/").split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\x00" in name:
        raise ModelLoadError(f"{url}: the object {key!r} would be copied outside the cache ({name!r}); "
                             f"refused")
    path = directory / name
    if not os.path.realpath(path).startswith(os.path.realpath(directory) + os.sep):
        raise ModelLoadError(f"{url}: the object {key!r} would be copied outside the cache; refused")
    return path


@contextlib.contextmanager
def cache_entry(target: Path):
    """Holds `target`'s file lock and yields a fresh temporary directory beside it, renamed to
    `target` when the block ends without an error (a leftover of a copy that died is replaced)."""
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{target.name}.lock")):
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            yield tmp
            if (tmp / ".complete").exists():
                if target.exists():
                    shutil.rmtree(target)  # an unfinished copy from before
                os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def etag(info: dict) -> str | None:
    value = info.get("ETag") or info.get("etag") or info.get("md5Hash")
    return str(value).strip('"') if value else None


def fetch_checked(fs, remote: str, local: Path, info: dict, url: str) -> None:
    """One object to `local`, checked against its listing: its size, and its MD5 where the ETag is one
    (a single-part upload's)."""
    try:
        fs.get_file(remote, str(local))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot copy {url}: {remote}: {one_line(exc)}") from exc
    size, tag = info.get("size"), etag(info)
    if size is not None and local.stat().st_size != size:
        raise ModelLoadError(f"cannot copy {url}: {remote} arrived with {local.stat().st_size:,} of {size:,} bytes")
    if tag and len(tag) == 32 and all(c in "0123456789abcdef" for c in tag.lower()):
        digest = hashlib.md5(usedforsecurity=False)
        with open(local, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        if digest.hexdigest() != tag.lower():
            raise ModelLoadError(f"cannot copy {url}: {remote} does not match its ETag (MD5 {digest.hexdigest()})")


def check_weights(path: Path, allow_pickle: bool, names: list[str] | None = None) -> None:
    """Refuses pickle-only weights unless the user opted in. `names`: the model's file names
    when they are not all in `path` (a Hub model checked before its weights are fetched)."""
    names = [p.name for p in path.iterdir()] if names is None else names
    if any(n.endswith(".safetensors") for n in names):
        return
    pickles = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
    if not pickles:
        raise ModelLoadError(f"no weights in {path} (expected *.safetensors)")
    if not allow_pickle:
        raise ModelLoadError(
            f"{path} has only pickle weights ({pickles[0]}); unpickling can run arbitrary code, "
            "so it needs allow_pickle=True (or convert the weights to safetensors)")


def load_tokenizer(config: EngineConfig, model_dir: Path):
    from transformers import AutoTokenizer

    tok_dir = resolve_model_dir(config, config.tokenizer, weights=False) if config.tokenizer else model_dir
    try:
        return AutoTokenizer.from_pretrained(tok_dir, trust_remote_code=config.trust_remote_code)
    except Exception as exc:  # transformers raises many types here
        raise ModelLoadError(f"cannot load tokenizer from {tok_dir}: {one_line(exc)}") from exc


def read_config(config: EngineConfig, model_dir: Path):
    """The model's transformers config."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir, trust_remote_code=config.trust_remote_code)
