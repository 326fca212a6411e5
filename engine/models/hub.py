"""Hugging Face Hub model ids (`org/name`, optional revision), resolved to a snapshot in the hub's
own cache through huggingface_hub, downloading only what loading needs.

The environment is read at each call, not at import: HF_HUB_CACHE / HF_HOME (where the cache
is), HF_HUB_OFFLINE (cache only), HF_ENDPOINT, and HF_TOKEN (read by huggingface_hub itself,
with the token file of `hf auth login` as fallback). Downloads of one repository are serialised
by a file lock in the cache, so the engines of one node download a model once.
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from engine.api.errors import ModelLoadError, one_line

log = logging.getLogger(__name__)

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
METADATA_PATTERNS = ("*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "tokenizer*")
"""config.json, generation_config.json, tokenizer files, chat templates, safetensors indexes."""
SAFETENSORS_PATTERNS = ("*.safetensors",)
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth")
CODE_PATTERNS = ("*.py",)
IGNORE_PATTERNS = ("original/*", "consolidated*", "onnx/*")
"""Second copies of the weights in other formats (Meta's and Mistral's originals, ONNX)."""


def is_hub_id(ref: str) -> bool:
    """Whether `ref` has the shape of a Hub model id (`org/name`); an existing local path has
    been ruled out by the caller."""
    return bool(HUB_ID.match(ref)) and "--" not in ref and ".." not in ref and len(ref) <= 96


def cache_dir() -> Path:
    """The hub cache: HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    env = os.environ
    explicit = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def offline() -> bool:
    return any(os.environ.get(k, "").strip().upper() in ("1", "ON", "YES", "TRUE")
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def resolve(repo_id: str, revision: str | None = None, *, weights: bool = True, allow_pickle: bool = False,
            trust_remote_code: bool = False) -> Path:
    """Local snapshot directory of `repo_id` at `revision` (None = main). With weights=False only
    the config and tokenizer files are fetched (enough to check a job before any actor starts).
    Pickle weights are fetched only with allow_pickle and only when there are no safetensors."""
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()  # per-file bars would tangle with a job's own progress output
    patterns = list(METADATA_PATTERNS) + (list(CODE_PATTERNS) if trust_remote_code else [])
    if weights:
        patterns += SAFETENSORS_PATTERNS
    if offline():
        return _snapshot(repo_id, revision, patterns)
    with _download_lock(repo_id):
        path = _snapshot(repo_id, revision, patterns)
        if weights and allow_pickle and not any(path.glob("*.safetensors")):
            path = _snapshot(repo_id, revision, patterns + list(PICKLE_PATTERNS))
    return path


def gguf_path(repo_id: str, tag: str, revision: str | None = None) -> Path:
    """The local copy of one GGUF file of a Hub repository, fetched alone: `tag` is its file name
    (`model-Q4_K_M.gguf`) or a quantization tag (`Q4_K_M`, vLLM's `org/repo:Q4_K_M`) matched
    against the repository's .gguf file names."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()
    filename = tag
    if not tag.endswith(".gguf"):
        names = [n for n in _repo_files(repo_id, revision) if n.endswith(".gguf")]
        matched = [n for n in names if tag.lower() in n.rsplit("/", 1)[-1].lower()]
        if len(matched) != 1:
            listed = ", ".join(names[:6]) or "none"
            what = "no" if not matched else f"{len(matched)}"
            raise ModelLoadError(f"Hugging Face model {repo_id}: {what} GGUF files match {tag!r} (its GGUF files: "
                                 f"{listed}); name the file with engine.gguf_file")
        filename = matched[0]
    try:
        if offline():
            return Path(hf_hub_download(repo_id, filename, revision=revision, cache_dir=cache_dir(),
                                        local_files_only=True))
        with _download_lock(repo_id):
            return Path(hf_hub_download(repo_id, filename, revision=revision, cache_dir=cache_dir(),
                                        endpoint=os.environ.get("HF_ENDPOINT")))
    except Exception as exc:  # noqa: BLE001  huggingface_hub raises HTTP, OS and value errors here
        raise _describe(exc, repo_id, revision) from exc


def _repo_files(repo_id: str, revision: str | None) -> list[str]:
    if offline():
        snapshot = _snapshot(repo_id, revision, ["*.json"])
        return [str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file() or p.is_symlink()]
    from huggingface_hub import HfApi

    try:
        return HfApi(endpoint=os.environ.get("HF_ENDPOINT")).list_repo_files(repo_id, revision=revision)
    except Exception as exc:  # noqa: BLE001
        raise _describe(exc, repo_id, revision) from exc


def list_files(repo_id: str, revision: str | None, snapshot: Path) -> list[str]:
    """Names of the repository's files: from the Hub, or (offline) those in the cached snapshot."""
    if offline():
        return [p.name for p in snapshot.iterdir()]
    from huggingface_hub import HfApi

    try:
        return HfApi(endpoint=os.environ.get("HF_ENDPOINT")).list_repo_files(repo_id, revision=snapshot.name)
    except Exception as exc:  # noqa: BLE001  the snapshot itself resolved: describe, do not guess
        raise _describe(exc, repo_id, revision) from exc


def _snapshot(repo_id: str, revision: str | None, patterns: list[str]) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(
            repo_id, revision=revision, cache_dir=cache_dir(), allow_patterns=patterns,
            ignore_patterns=list(IGNORE_PATTERNS), local_files_only=offline(),
            endpoint=os.environ.get("HF_ENDPOINT")))
    except Exception as exc:  # noqa: BLE001  huggingface_hub raises HTTP, OS and value errors here
        raise _describe(exc, repo_id, revision) from exc


def _describe(exc: Exception, repo_id: str, revision: str | None):
    """A one-line ModelLoadError naming the id, for what huggingface_hub raised."""
    from huggingface_hub import get_token
    from huggingface_hub.errors import (GatedRepoError, HFValidationError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    at = f" at revision {revision!r}" if revision else ""
    token = "HF_TOKEN is set" if get_token() else "no HF_TOKEN is set"
    if isinstance(exc, GatedRepoError):
        text = (f"Hugging Face model {repo_id} is gated: accept its terms on its Hub page and use a token "
                f"with access ({token})")
    elif isinstance(exc, RepositoryNotFoundError):
        text = f"Hugging Face model {repo_id} not found on the Hub (or private, and {token})"
    elif isinstance(exc, RevisionNotFoundError):
        text = f"Hugging Face model {repo_id} has no revision {revision!r}"
    elif isinstance(exc, LocalEntryNotFoundError):
        why = "HF_HUB_OFFLINE is set" if offline() else "the Hub could not be reached"
        text = f"Hugging Face model {repo_id}{at} is not in the cache {cache_dir()} and {why}"
    elif isinstance(exc, HFValidationError):
        text = f"{repo_id!r} is neither a local model directory nor a valid Hugging Face model id"
    else:
        text = f"cannot fetch Hugging Face model {repo_id}{at}: {one_line(exc)}"
    return ModelLoadError(text)


class _download_lock:
    """A per-repository file lock in the cache: one download per node, others wait for it."""

    def __init__(self, repo_id: str):
        from filelock import FileLock

        path = cache_dir() / ".locks" / ("models--" + repo_id.replace("/", "--")) / "batchinfer-snapshot.lock"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ModelLoadError(f"cannot write to the Hugging Face cache {cache_dir()} to fetch {repo_id} "
                                 f"(set HF_HUB_CACHE, or HF_HUB_OFFLINE=1 for a read-only cache): {one_line(exc)}")
        self.repo_id, self.lock = repo_id, FileLock(str(path))

    def __enter__(self):
        from filelock import Timeout

        try:
            self.lock.acquire(timeout=0)
        except Timeout:
            log.warning("waiting for another process downloading %s", self.repo_id)
            self.lock.acquire()
        return self

    def __exit__(self, *exc):
        self.lock.release()
