"""Model directories from the outside world: a builtin, a local directory, a copy of an
object-storage URL or a Hugging Face Hub snapshot (engine.models.hub); their weights checked,
their config and tokenizer read."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from engine.api.config import EngineConfig
from engine.api.errors import ModelLoadError, one_line
from engine.models import hub
from engine.models.builtin import builtin_path, default_cache_dir, is_builtin

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def resolve_model_dir(config: EngineConfig, which: str | None = None, weights: bool = True) -> Path:
    """Local directory holding `which` (default: config.model): a builtin, a local directory, a
    copy of an object-storage URL, or a Hugging Face Hub snapshot. An existing local path wins
    over a Hub id of the same shape. weights=False fetches only config and tokenizer files of a
    Hub model (the other kinds are resolved whole)."""
    ref = which or config.model
    if is_builtin(ref):
        return builtin_path(ref, config.cache_dir)
    if ref.startswith("file://"):
        ref = ref[len("file://"):]
    if "://" in ref:
        return copy_remote(ref, Path(config.cache_dir) if config.cache_dir else default_cache_dir())
    path = Path(ref).expanduser()
    if is_hub_model(ref):
        revision = config.revision if which is None or which == config.model else None
        return hub.resolve(ref, revision, weights=weights, allow_pickle=config.allow_pickle,
                           trust_remote_code=config.trust_remote_code)
    gguf = [path] if path.suffix == ".gguf" and path.is_file() else (
        sorted(path.glob("*.gguf")) if path.is_dir() and not any(path.glob("*.safetensors")) else [])
    if gguf:
        raise ModelLoadError(f"{ref}: quantization method 'gguf' is not supported ({gguf[0].name}); use the model's "
                             "safetensors weights, or a GPTQ, AWQ or compressed-tensors checkpoint")
    if not path.is_dir():
        raise ModelLoadError(f"model directory not found: {ref}")
    if not (path / "config.json").exists():
        raise ModelLoadError(f"{ref} is not a Hugging Face model directory (no config.json)")
    return path


def is_hub_model(ref: str) -> bool:
    """A Hugging Face Hub id: `org/name` shaped, not a builtin, a URL or an existing local path."""
    return not is_builtin(ref) and "://" not in ref and not Path(ref).expanduser().exists() and hub.is_hub_id(ref)


def check_model_files(config: EngineConfig) -> Path:
    """Resolves config.model and checks its weights without fetching a Hub model's weights (the
    Hub's file list is checked instead). Returns the directory holding config and tokenizer."""
    path = resolve_model_dir(config, weights=False)
    names = hub.list_files(config.model, config.revision, path) if is_hub_model(config.model) else None
    check_weights(path, config.allow_pickle, names)
    return path


def copy_remote(url: str, cache_dir: Path) -> Path:
    """A local copy of every file under an object-storage URL (made once: a finished copy is marked)."""
    import fsspec

    target = cache_dir / "models" / hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    marker = target / ".complete"
    if marker.exists():
        return target
    try:
        fs, root = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as exc:
        raise ModelLoadError(f"cannot open {url}: {exc}") from exc
    root = root.rstrip("/")
    files = [f for f in fs.find(root) if not f.endswith("/")]
    if not files:
        raise ModelLoadError(f"no files under {url}")
    for remote in files:
        local = target / os.path.relpath(remote, root)
        local.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(remote, str(local) + ".part")
        os.replace(str(local) + ".part", local)
    marker.touch()
    return target


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
