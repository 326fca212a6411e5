"""Finds, checks and loads model directories: local, object storage (copied first), Hugging Face
Hub ids (engine.hub) or builtin."""
from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path

from engine import hub
from engine.builtin import builtin_path, default_cache_dir, is_builtin, quiet_transformers
from engine.config import EngineConfig
from engine.errors import ModelLoadError, one_line

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
        return _copy_remote(ref, Path(config.cache_dir) if config.cache_dir else default_cache_dir())
    path = Path(ref).expanduser()
    if is_hub_model(ref):
        revision = config.revision if which is None or which == config.model else None
        return hub.resolve(ref, revision, weights=weights, allow_pickle=config.allow_pickle,
                           trust_remote_code=config.trust_remote_code)
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


def _copy_remote(url: str, cache_dir: Path) -> Path:
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


UNSUPPORTED_MODEL_TYPES = {
    "bloom": "ALiBi attention", "mpt": "ALiBi attention", "baichuan": "ALiBi attention",
    "mamba": "recurrent layers", "mamba2": "recurrent layers", "falcon_mamba": "recurrent layers",
    "jamba": "recurrent layers", "zamba": "recurrent layers", "zamba2": "recurrent layers",
    "rwkv": "recurrent layers", "recurrent_gemma": "recurrent layers", "xlstm": "recurrent layers",
    "bamba": "recurrent layers", "falcon_h1": "recurrent layers", "granitemoehybrid": "recurrent layers",
    "nemotron_h": "recurrent layers", "lfm2": "convolution layers", "qwen3_next": "linear-attention layers",
    "minimax": "linear-attention layers", "olmo_hybrid": "linear-attention layers",
}
"""Architectures whose layers need more than keys and values in a paged pool."""
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}


def read_config(config: EngineConfig, model_dir: Path):
    """The model's transformers config."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir, trust_remote_code=config.trust_remote_code)


def check_architecture(hf_config) -> None:
    """Refuses, in one line naming it, an architecture the engine's paged attention cannot run."""
    text = hf_config.get_text_config(decoder=True)
    kind = UNSUPPORTED_MODEL_TYPES.get(getattr(text, "model_type", ""))
    if kind is None and (getattr(text, "alibi", False) or getattr(text, "position_embedding_type", "") == "alibi"):
        kind = "ALiBi attention"
    other = set(getattr(text, "layer_types", None) or ()) - ATTENTION_LAYER_TYPES
    if kind is None and other:
        kind = f"{', '.join(sorted(other))} layers"
    if kind is not None:
        archs = ", ".join(getattr(hf_config, "architectures", None) or [getattr(text, "model_type", "?")])
        raise ModelLoadError(f"{archs} is not supported: its {kind} do not run on the engine's paged KV attention")


def load_model(config: EngineConfig, model_dir: Path, dtype, device, checkpoint_quantization: str | None = None):
    """The causal LM in eval mode on `device`, with the engine's paged attention. A
    compressed-tensors checkpoint is dequantized as it loads (the engine requantizes it)."""
    from transformers import AutoModelForCausalLM

    from engine import attention

    check_weights(model_dir, config.allow_pickle)
    quiet_transformers()
    chosen = config.extra.get("attn_implementation")
    if chosen is not None and chosen != attention.IMPLEMENTATION:
        raise ModelLoadError(f"engine.extra attn_implementation={chosen!r} cannot be used: the engine runs "
                             f"attention over its paged KV pool ({attention.IMPLEMENTATION}); remove the key")
    try:
        check_architecture(read_config(config, model_dir))
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"cannot load model config from {model_dir}: {one_line(exc)}") from exc
    kwargs = {**config.extra, "attn_implementation": attention.register()}
    if checkpoint_quantization and checkpoint_quantization.startswith("compressed-tensors"):
        try:
            from transformers.utils.quantization_config import CompressedTensorsConfig

            kwargs["quantization_config"] = CompressedTensorsConfig(dequantize=True)
        except ImportError as exc:
            raise ModelLoadError(f"{checkpoint_quantization} checkpoint: {one_line(exc)}") from exc
    try:
        with warnings.catch_warnings():
            # transformers warns that the checkpoint's own quantization_config wins over ours,
            # of which only `dequantize` is read anyway: the intended outcome
            warnings.filterwarnings("ignore", message="You passed `quantization_config`")
            model = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=dtype, trust_remote_code=config.trust_remote_code,
                use_safetensors=None if config.allow_pickle else True, **kwargs)
    except Exception as exc:
        what = f"{checkpoint_quantization} checkpoint " if checkpoint_quantization else ""
        raise ModelLoadError(f"cannot load {what}model from {model_dir}: {one_line(exc)}") from exc
    return model.to(device).eval()
