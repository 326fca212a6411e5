"""What a model directory says about pooling: its sentence-transformers modules (Pooling,
Dense, Normalize), its classification head and labels, and which of embed, classify and score
it can serve. Reads JSON files only (no torch), so a job's preflight can refuse a model early."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from engine.api.errors import ModelLoadError
from engine.api.pooling import PoolerConfig

ENCODER_TYPES = ("bert", "roberta", "xlm-roberta", "camembert", "modernbert")
"""Bidirectional encoders the engine packs without padding (their attention goes through
transformers' attention registry, which the engine's varlen attention plugs into)."""
ST_POOLING_MODES = {"mean": "MEAN", "cls": "CLS", "lasttoken": "LAST", "max": "MAX"}
"""sentence-transformers pooling modes the engine runs, by its names."""
ST_MODULES = ("Transformer", "Pooling", "Dense", "Normalize", "LogitScore")
ACTIVATIONS = {"identity": "identity", "sigmoid": "sigmoid", "tanh": "tanh", "relu": "relu", "gelu": "gelu"}


@dataclass
class DenseLayer:
    """A sentence-transformers Dense module: a linear layer (and activation) after pooling."""

    path: Path
    in_features: int
    out_features: int
    bias: bool
    activation: str


@dataclass
class PoolingInfo:
    """How the engine pools a model, as its files say (EngineConfig.pooling applied)."""

    name: str
    """The model's architecture, for messages (e.g. BertModel)."""
    kind: str
    """encoder | decoder | seq2seq."""
    model_type: str
    hidden_size: int
    pooling_type: str
    """MEAN, CLS, LAST or MAX."""
    normalize: bool
    """L2-normalise embeddings."""
    sentence_transformers: bool = False
    """The directory is a sentence-transformers model (modules.json)."""
    include_prompt: bool = True
    dense: list[DenseLayer] = field(default_factory=list)
    num_labels: int = 0
    """Outputs of the classification head; 0 = no head."""
    labels: list[str] = field(default_factory=list)
    """id2label names in label order."""
    score_activation: str = "sigmoid"
    """What `score` applies to a one-label head's logit (sentence-transformers' CrossEncoder default)."""
    matryoshka: tuple[int, ...] | bool = False
    """Dimensions a Matryoshka model may be cut to (True: any)."""
    max_len: int | None = None
    """Longest row the model reads (positions, or the sentence-transformers max_seq_length)."""
    can_generate: bool = False

    @property
    def classifier(self) -> bool:
        return self.num_labels > 0

    @property
    def width(self) -> int:
        """The embedding's dimensions before any cut."""
        return self.dense[-1].out_features if self.dense else self.hidden_size

    def refusal(self, task: str) -> str | None:
        """Why this model cannot serve `task` (embed, classify, score, generate), in one line; None if it can."""
        what = f"{task}: {self.name}"
        if self.kind == "seq2seq":
            return f"{what} is an encoder-decoder (seq2seq) model: pooling runs on encoders and decoder LMs"
        if task == "generate":
            return None if self.can_generate else (f"{what} has no language-model head: it can embed, classify or "
                                                   "score, not generate")
        if task == "classify" and not self.classifier:
            return f"{what} has no classification head (a *ForSequenceClassification model with id2label)"
        if task == "embed" and self.classifier:
            return f"{what} is a classifier with {self.num_labels} labels: use classify (or score for a cross-encoder)"
        if task == "score" and self.classifier and self.num_labels != 1:
            return (f"{what} has {self.num_labels} labels: score needs a cross-encoder (num_labels 1) or an "
                    "embedding model")
        return None

    def check(self, task: str) -> None:
        reason = self.refusal(task)
        if reason is not None:
            raise ModelLoadError(reason)

    def check_engine(self, quantization: str | None, tensor_parallel_size: int) -> None:
        """Refuses, in one line, what an encoder's own runner does not run: quantized weights and
        tensor parallelism (it would run in float on one device while a job reserved a GPU per rank)."""
        if self.kind != "encoder":
            return
        if quantization is not None:
            raise ModelLoadError(f"{self.name} is an encoder: quantization {quantization} is not run on encoders "
                                 "(their packed runner computes in the model's dtype); set quantization: null")
        if tensor_parallel_size > 1:
            raise ModelLoadError(f"{self.name} is an encoder: tensor_parallel_size {tensor_parallel_size} is not run "
                                 "on encoders (their runner takes one device); set tensor_parallel_size: 1")


def pooling_info(model_dir: Path, hf_config: dict, override: dict | None = None) -> PoolingInfo:
    """What `model_dir` (its config.json read as `hf_config`) says about pooling."""
    archs = hf_config.get("architectures") or []
    name = archs[0] if archs else hf_config.get("model_type", "model")
    model_type = hf_config.get("model_type", "")
    text = hf_config.get("text_config") or hf_config
    if hf_config.get("is_encoder_decoder"):
        kind = "seq2seq"
    elif model_type in ENCODER_TYPES and not hf_config.get("is_decoder"):
        kind = "encoder"
    else:
        kind = "decoder"
    classifier = any(a.endswith("ForSequenceClassification") for a in archs)
    labels = _labels(hf_config) if classifier else []
    info = PoolingInfo(
        name=name, kind=kind, model_type=model_type, hidden_size=int(text.get("hidden_size") or text.get("d_model") or 0),
        pooling_type="CLS" if kind == "encoder" else "LAST", normalize=kind == "decoder" and not classifier,
        num_labels=len(labels), labels=labels, max_len=_max_len(hf_config, model_type),
        can_generate=any(a.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")) for a in archs),
        matryoshka=_matryoshka(hf_config))
    if kind == "encoder" and model_type == "modernbert" and classifier:
        info.pooling_type = "MEAN" if hf_config.get("classifier_pooling") == "mean" else "CLS"
    if (model_dir / "modules.json").exists():
        _read_sentence_transformers(model_dir, info)
    chosen = PoolerConfig.from_value(override)
    if chosen.pooling_type is not None:
        info.pooling_type = chosen.pooling_type
    if chosen.normalize is not None:
        info.normalize = chosen.normalize
    return info


def _labels(hf_config: dict) -> list[str]:
    id2label = hf_config.get("id2label") or {}
    n = hf_config.get("num_labels") or len(id2label) or 2
    return [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(n)]


def _max_len(hf_config: dict, model_type: str) -> int | None:
    n = hf_config.get("max_position_embeddings") or (hf_config.get("text_config") or {}).get("max_position_embeddings")
    if n and model_type in ("roberta", "xlm-roberta", "camembert"):
        n -= (hf_config.get("pad_token_id") or 1) + 1  # positions start after the padding index
    return n


def _matryoshka(hf_config: dict) -> tuple[int, ...] | bool:
    dims = hf_config.get("matryoshka_dimensions")
    if dims:
        return tuple(int(d) for d in dims)
    return bool(hf_config.get("is_matryoshka"))


def _read_sentence_transformers(model_dir: Path, info: PoolingInfo) -> None:
    """modules.json: the Transformer, then Pooling, Dense and Normalize modules in order."""
    try:
        modules = json.loads((model_dir / "modules.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{model_dir}/modules.json cannot be read: {exc}") from None
    info.sentence_transformers = True
    info.normalize = False
    pooled = False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        path = model_dir / module.get("path", "")
        if kind not in ST_MODULES:
            raise ModelLoadError(f"{model_dir}: sentence-transformers module {module.get('type')!r} is not supported "
                                 f"(the engine runs {', '.join(ST_MODULES)})")
        if kind == "Pooling":
            _read_pooling(path, info)
            pooled = True
        elif kind == "Dense":
            cfg = _json(path / "config.json")
            act = str(cfg.get("activation_function", "torch.nn.modules.linear.Identity")).rsplit(".", 1)[-1].lower()
            if act not in ACTIVATIONS:
                raise ModelLoadError(f"{path}: Dense activation {cfg.get('activation_function')!r} is not supported")
            info.dense.append(DenseLayer(path, int(cfg["in_features"]), int(cfg["out_features"]),
                                         bool(cfg.get("bias", True)), act))
        elif kind == "Normalize":
            info.normalize = True
    if not pooled and info.classifier:
        return
    st = _json(model_dir / "config_sentence_transformers.json", missing_ok=True)
    act = str(st.get("activation_fn") or "").rsplit(".", 1)[-1].lower()
    if act:
        info.score_activation = ACTIVATIONS.get(act, info.score_activation)
    bert = _json(model_dir / "sentence_bert_config.json", missing_ok=True)
    if bert.get("max_seq_length"):
        info.max_len = min(info.max_len or bert["max_seq_length"], int(bert["max_seq_length"]))


def _read_pooling(path: Path, info: PoolingInfo) -> None:
    cfg = _json(path / "config.json")
    mode = cfg.get("pooling_mode")
    if mode is None:  # sentence-transformers < 5: one flag per mode
        on = [m for m in ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens",
                          "lasttoken") if cfg.get(f"pooling_mode_{m}")]
        if len(on) != 1:
            raise ModelLoadError(f"{path}/config.json: the engine pools one way, this config turns on {on or 'none'}")
        mode = {"cls_token": "cls", "mean_tokens": "mean", "max_tokens": "max", "lasttoken": "lasttoken"}.get(on[0], on[0])
    if mode not in ST_POOLING_MODES:
        raise ModelLoadError(f"{path}/config.json: pooling mode {mode!r} is not supported (the engine pools "
                             f"{', '.join(ST_POOLING_MODES)})")
    info.pooling_type = ST_POOLING_MODES[mode]
    info.include_prompt = bool(cfg.get("include_prompt", True))


def _json(path: Path, missing_ok: bool = False) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        if missing_ok:
            return {}
        raise ModelLoadError(f"{path} is missing") from None
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} cannot be read: {exc}") from None


def read_pooling_info(config) -> PoolingInfo:
    """PoolingInfo of config.model (resolved as the engine loads it), config.pooling applied."""
    from engine.models.files import resolve_model_dir

    return model_pooling_info(resolve_model_dir(config), config.pooling)


def model_pooling_info(model_dir: Path, override: dict | None = None) -> PoolingInfo:
    """PoolingInfo of a resolved model directory (config files only: no weights needed)."""
    return pooling_info(model_dir, _json(model_dir / "config.json"), override)
