"""LoRA adapters from the outside world: a PEFT directory found (local, object storage, Hub), its
config and safetensors read, and every module it adapts checked against the base model.

An adapter is refused in one line (AdapterError) that names it and the reason: files missing or
corrupt, a rank above max_lora_rank, DoRA, biases or whole modules saved beside it, a module the
engine cannot adapt (embeddings, the LM head, anything but a decoder layer's linear projections),
or shapes of another base model."""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.api.config import EngineConfig
from engine.api.errors import AdapterError, ModelLoadError, one_line
from engine.api.lora import LoRARequest
from engine.models import copy_remote, default_cache_dir, is_hub_model
from engine.models import hub

CONFIG = "adapter_config.json"
WEIGHTS = ("adapter_model.safetensors",)
KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>A|B|embedding_A|embedding_B|magnitude_vector)"
                 r"(?:\.(?!weight$|bias$)[A-Za-z0-9_-]+)?(?:\.weight)?$")
"""A PEFT tensor name: base_model.model.<module>.lora_A.weight (an adapter name may sit before .weight;
`weight` and `bias` are never taken for one: lora_B.bias is a bias, which is refused)."""
APPLIED = ("peft_type", "r", "lora_alpha", "use_rslora", "alpha_pattern", "rank_pattern", "target_modules",
           "exclude_modules", "layers_to_transform", "layers_pattern", "base_model_name_or_path")
"""peft.LoraConfig fields the engine applies: the scaling (alpha, rsLoRA, alpha_pattern), and which modules
at what rank (read from the tensors themselves: target_modules, exclude_modules, layers_*, rank_pattern)."""
IGNORED = ("task_type", "auto_mapping", "peft_version", "revision", "inference_mode", "lora_dropout",
           "init_lora_weights", "megatron_config", "megatron_core", "loftq_config", "eva_config", "corda_config",
           "lora_ga_config", "runtime_config", "qalora_group_size", "ensure_weight_tying")
"""Fields that do not change inference (training, initialisation, bookkeeping; QA-LoRA's group size
without use_qalora; weight tying, which only adapters of the embeddings need, themselves refused)."""
REFUSED = {"fan_in_fan_out": "GPT-2's Conv1D layers", "bias": "trained biases", "modules_to_save": "whole modules",
           "use_dora": "DoRA", "lora_bias": "a bias on lora_B", "trainable_token_indices": "trained embedding rows",
           "velora_config": "VeLoRA", "alora_invocation_tokens": "activated LoRA (aLoRA)", "use_qalora": "QA-LoRA",
           "monteclora_config": "MonteCLoRA", "layer_replication": "replicated layers",
           "target_parameters": "adapters on parameters (MoE experts)", "use_bdlora": "BD-LoRA",
           "arrow_config": "Arrow routing", "kasa_config": "KaSA"}
"""Fields whose non-default values change the forward in ways the engine does not run: refused in
one line naming the field (tests/engine/test_lora.py holds these three tables to peft.LoraConfig's fields)."""


@dataclass
class AdapterWeights:
    """One adapter as read on the host: per adapted module, A (r, in) and B * scaling (out, r), float32."""

    request: LoRARequest
    path: Path
    """The local directory it was read from."""
    digest: bytes
    """sha256 of its config and weights: what salts its prefix-cache names (and a job's fingerprint)."""
    rank: int
    """Its largest rank."""
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """Module name (as the base model names it) -> (A, B scaled)."""

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.modules.values())


def resolve_adapter_dir(path: str, config: EngineConfig) -> Path:
    """Local directory of an adapter: a directory, a copy of an s3:// / gs:// URL (in the cache), or
    a Hub snapshot (huggingface_hub's cache; offline-aware as models are)."""
    ref = path[len("file://"):] if path.startswith("file://") else path
    try:
        if "://" in ref:
            local = copy_remote(ref, Path(config.cache_dir) if config.cache_dir else default_cache_dir())
        elif is_hub_model(ref):
            local = hub.resolve(ref, None, weights=True)
        else:
            local = Path(ref).expanduser()
    except ModelLoadError as exc:
        raise AdapterError(str(exc)) from None
    if not local.is_dir():
        raise AdapterError(f"no directory at {path}")
    if not (local / CONFIG).exists():
        raise AdapterError(f"{path} is not a PEFT adapter directory (no {CONFIG})")
    return local


def file_digest(local: Path) -> bytes:
    """sha256 over the adapter's config and weight files, read in 1 MiB pieces."""
    h = hashlib.sha256()
    for name in (CONFIG,) + WEIGHTS:
        p = local / name
        if p.exists():
            h.update(name.encode())
            with open(p, "rb") as f:
                for piece in iter(lambda: f.read(1 << 20), b""):
                    h.update(piece)
    return h.digest()


def read_adapter(request: LoRARequest, config: EngineConfig, targets: dict[str, tuple[int, int]]) -> AdapterWeights:
    """Reads and checks `request`'s adapter. `targets`: module name -> (in_features, out_features)
    of every module the engine can adapt in the base model (engine.lora.layers.adaptable)."""
    name = request.lora_name
    try:
        local = resolve_adapter_dir(request.lora_path, config)
    except AdapterError as exc:
        raise AdapterError(f"adapter {name}: {exc}") from None
    try:
        cfg = json.loads((local / CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"adapter {name}: cannot read {CONFIG}: {one_line(exc)}") from None
    settings = _settings(name, cfg)
    tensors = _tensors(name, local)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = KEY.match(key)
        if m is None and key.endswith(".bias") and ".lora_" in key:
            raise AdapterError(f"adapter {name}: {key} is a LoRA bias (lora_bias), which is not supported")
        if m is None:
            raise AdapterError(f"adapter {name}: {key} is not a LoRA tensor (whole modules saved beside an adapter "
                               "are not supported)")
        part, module = m["part"], m["module"]
        if part == "magnitude_vector":
            raise AdapterError(f"adapter {name}: DoRA (use_dora) is not supported")
        if part.startswith("embedding"):
            raise AdapterError(f"adapter {name}: it adapts the embedding {module}; the engine adapts only the "
                               "attention and MLP projections")
        pairs.setdefault(module, {})[part] = tensor
    if not pairs:
        raise AdapterError(f"adapter {name}: its weights hold no LoRA tensors")
    out = AdapterWeights(request, local, file_digest(local), 0)
    base = cfg.get("base_model_name_or_path") or "its base model"
    for module, parts in sorted(pairs.items()):
        if set(parts) != {"A", "B"}:
            raise AdapterError(f"adapter {name}: {module} has lora_{'A' if 'A' not in parts else 'B'} missing")
        a, b = parts["A"].float(), parts["B"].float()
        if module not in targets:
            leaf = module.rsplit(".", 1)[-1]
            what = "the LM head" if leaf in ("lm_head", "embed_out", "output") else f"{module}"
            raise AdapterError(f"adapter {name}: it adapts {what}, which the engine cannot target (only the linear "
                               "projections of the decoder layers; none of that name in this base model)")
        fan_in, fan_out = targets[module]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r:
            raise AdapterError(f"adapter {name}: {module}'s lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                               "are not a LoRA pair")
        if (a.shape[1], b.shape[0]) != (fan_in, fan_out):
            raise AdapterError(f"adapter {name}: it does not match the base model: {module} maps {a.shape[1]} -> "
                               f"{b.shape[0]} features in the adapter (trained on {base}), {fan_in} -> {fan_out} here")
        if r > config.max_lora_rank:
            raise AdapterError(f"adapter {name}: rank {r} exceeds max_lora_rank ({config.max_lora_rank})")
        out.modules[module] = (a.contiguous(), (b * _scaling(module, r, settings)).contiguous())
        out.rank = max(out.rank, r)
    return out


def _settings(name: str, cfg: dict) -> dict:
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"adapter {name}: peft_type {cfg.get('peft_type')!r} is not LoRA")
    if cfg.get("use_dora"):
        raise AdapterError(f"adapter {name}: DoRA (use_dora) is not supported")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"adapter {name}: bias {cfg['bias']!r} is not supported (only bias: none)")
    for key, what in REFUSED.items():
        value = cfg.get(key)
        if value not in (None, False, "none", {}, []) and key not in ("modules_to_save", "fan_in_fan_out"):
            raise AdapterError(f"adapter {name}: {key} ({what}) is not supported")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"adapter {name}: modules_to_save ({', '.join(cfg['modules_to_save'])}) replaces whole "
                           "modules, which the engine cannot serve beside the base model")
    if cfg.get("fan_in_fan_out"):
        raise AdapterError(f"adapter {name}: fan_in_fan_out (GPT-2's Conv1D layers) is not supported")
    for key in ("r", "lora_alpha"):
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise AdapterError(f"adapter {name}: {key} must be a positive number, got {value!r}")
    return {"alpha": cfg.get("lora_alpha") or cfg.get("r") or 8, "rslora": bool(cfg.get("use_rslora")),
            "alpha_pattern": cfg.get("alpha_pattern") or {}}


def _scaling(module: str, r: int, settings: dict) -> float:
    """PEFT's scaling: alpha / r (alpha / sqrt(r) with rsLoRA), alpha from alpha_pattern where a key
    matches the module's name as PEFT matches it."""
    alpha = settings["alpha"]
    for pattern, value in settings["alpha_pattern"].items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            alpha = value
            break
    return alpha / (math.sqrt(r) if settings["rslora"] else r)


def _tensors(name: str, local: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = local / WEIGHTS[0]
    if not path.exists():
        pickles = [p.name for p in local.glob("adapter_model.bin")]
        hint = f" (it has {pickles[0]}: convert it to safetensors)" if pickles else ""
        raise AdapterError(f"adapter {name}: no {WEIGHTS[0]} in {local}{hint}")
    try:
        return load_file(str(path))
    except Exception as exc:  # noqa: BLE001  safetensors raises its own error types for a corrupt file
        raise AdapterError(f"adapter {name}: {WEIGHTS[0]} is corrupt or unreadable: {one_line(exc)}") from None
