"""Loads a model directory's causal LM onto its device with the engine's paged attention, after
refusing, in one line, an architecture that attention cannot run."""
from __future__ import annotations

import importlib
import sys
import threading
import warnings
from pathlib import Path

import torch

from engine.api.config import EngineConfig
from engine.api.errors import ModelLoadError, one_line
from engine.models.builtin import quiet_transformers
from engine.models.files import check_weights, read_config

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


def model_head(hf_config) -> str:
    """What sits on the decoder: causal (an LM head), classifier (*ForSequenceClassification's
    score) or base (none: a decoder embedder saved without its head)."""
    archs = getattr(hf_config, "architectures", None) or []
    if any(a.endswith("ForSequenceClassification") for a in archs):
        return "classifier"
    if archs and not any(a.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")) for a in archs):
        return "base"
    return "causal"


def auto_class(head: str):
    """The transformers auto class that builds a model with `head` (model_head's kinds)."""
    from transformers import (AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText,
                              AutoModelForSequenceClassification)

    return {"causal": AutoModelForCausalLM, "classifier": AutoModelForSequenceClassification, "base": AutoModel,
            "vision": AutoModelForImageTextToText}[head]


def load_model(config: EngineConfig, model_dir: Path, dtype, device, checkpoint_quantization: str | None = None,
               head: str = "causal"):
    """The decoder (with its LM head, classification head, or none: `head`; "vision": a
    vision-language model, its vision tower beside the decoder) in eval mode on
    `device`, with the engine's paged attention. A compressed-tensors checkpoint is dequantized
    as it loads (the engine requantizes it)."""
    attention = prepare_load(config, model_dir)
    # a vision-language model's vision tower attends over its own patches (SDPA), its decoder over the pool
    kwargs = {**config.extra, "attn_implementation": attention if head != "vision" else
              {"text_config": attention, "vision_config": "sdpa"}}
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
            model, info = auto_class(head).from_pretrained(
                model_dir, dtype=dtype, trust_remote_code=config.trust_remote_code,
                use_safetensors=None if config.allow_pickle else True, output_loading_info=True, **kwargs)
    except Exception as exc:
        what = f"{checkpoint_quantization} checkpoint " if checkpoint_quantization else ""
        raise ModelLoadError(f"cannot load {what}model from {model_dir}: {one_line(exc)}") from exc
    check_loaded(model_dir, info)
    return model.to(device).eval()


def check_loaded(model_dir: Path, info: dict) -> None:
    """Refuses a checkpoint that misses a parameter the architecture needs (transformers would
    initialise it at random and only log it: a classifier's head, a layer, a norm), naming up to
    five; tied weights and buffers transformers derives are not missing. Unexpected tensors are one
    warning line."""
    import logging

    missing = sorted(set(info.get("missing_keys") or ()))
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ModelLoadError(f"{model_dir}: the checkpoint misses {', '.join(missing[:5])}{more}: the architecture "
                             "needs them (loaded anyway, they would be random)")
    unexpected = sorted(set(info.get("unexpected_keys") or ()))
    if unexpected:
        logging.getLogger(__name__).warning("%s: %d tensor(s) the model does not use were left out: %s", model_dir,
                                            len(unexpected), ", ".join(unexpected[:5]))


def prepare_load(config: EngineConfig, model_dir: Path) -> str:
    """Checks the weights' files and the architecture, and imports the architecture's modeling
    code (so that a load's peak counts the weights, not the modules: ~18 MiB for Llama's, in a
    fresh tensor-parallel rank); returns the attention implementation."""
    from engine.runner import attention

    check_weights(model_dir, config.allow_pickle)
    quiet_transformers()
    chosen = config.extra.get("attn_implementation")
    if chosen is not None and chosen != attention.IMPLEMENTATION:
        raise ModelLoadError(f"engine.extra attn_implementation={chosen!r} cannot be used: the engine runs "
                             f"attention over its paged KV pool ({attention.IMPLEMENTATION}); remove the key")
    try:
        hf_config = read_config(config, model_dir)
        check_architecture(hf_config)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"cannot load model config from {model_dir}: {one_line(exc)}") from exc
    _import_model_code(hf_config)
    return attention.register()


FRAME_KEEPERS = ("torch._dynamo", "torch.distributed._functional_collectives")
"""Modules whose first import keeps the frames that imported it: each calls torch.fx's `wrap` at
its top level, which holds its own frame in a cycle. Imported below an engine's constructor, that
chain of frames would keep the engine alive until the cyclic collector runs."""


def import_apart(names: tuple[str, ...] = FRAME_KEEPERS) -> None:
    """Imports `names` not imported yet in a thread of their own, so the frames they keep are that
    thread's, never an engine constructor's (transformers imports torch._dynamo lazily)."""
    missing = [n for n in names if n not in sys.modules]
    if not missing:
        return
    failed: list[BaseException] = []

    def work():
        for name in missing:
            try:
                importlib.import_module(name)
            except ImportError:
                pass  # an optional part of torch: nothing of it will be imported later either
            except BaseException as exc:  # noqa: BLE001  raised again in the caller's thread
                failed.append(exc)

    thread = threading.Thread(target=work, name="import-apart")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]


def _import_model_code(hf_config) -> None:
    """Imports the module of the class a load builds from `hf_config` (nothing for remote code,
    or a config no auto class maps: the load finds those itself)."""
    try:
        auto_class(model_head(hf_config))._model_mapping[type(hf_config)]
    except (KeyError, ValueError):
        pass


def load_model_quantized(config: EngineConfig, model_dir: Path, dtype, device, method: str, head: str = "causal",
                         packed=None, shard: tuple | None = None):
    """The model with its linear layers quantized with `method` as each is read (nothing of it in
    full precision at once): (model, its weights' bytes unquantized), or None where that cannot
    be (the checkpoint's tensors are named otherwise, engine.extra keys for from_pretrained are
    set): load_model, then quantize. `packed`: the format
    (engine.quantization.checkpoints) of a quantized checkpoint whose layers load as stored.
    `shard` (styles, sections, rank, n): a tensor-parallel rank's shard instead, each tensor cut
    to the rank's slice as it is read (a rank but 0 without the LM head)."""
    from engine.distributed.tensor_parallel import NoHead, ShardedFiles, rank_config
    from engine.quantization.checkpoints import PackedFormat
    from engine.quantization.streaming import load_quantized

    attn = prepare_load(config, model_dir)
    if set(config.extra) - {"attn_implementation"} and not isinstance(packed, PackedFormat):
        return None
    cls = auto_class(head)
    hf_config, wrap, adapt, where = read_config(config, model_dir), None, None, ""
    if shard is not None:
        styles, sections, rank, n = shard
        layout = None if packed is None else packed.layout
        vocab = hf_config.vocab_size

        def wrap(files):
            return ShardedFiles(files, styles, sections, rank, n, layout)

        def adapt(model):
            if rank:  # rank 0 computes the logits
                model.set_output_embeddings(NoHead(vocab))
        hf_config, where = rank_config(hf_config, n), f" on rank {rank} of {n}"
    try:
        return load_quantized(cls, hf_config, model_dir, method, dtype, device, attn, config.trust_remote_code,
                              packed, wrap=wrap, adapt=adapt)
    except (ValueError, OSError) as exc:
        raise ModelLoadError(f"cannot load model from {model_dir} quantized with {method}{where}: "
                             f"{one_line(exc)}") from exc


def adapter_targets(config: EngineConfig, model_dir: Path) -> dict[str, tuple[int, int]]:
    """Module name -> (in, out) features of every projection a LoRA adapter may target in the model,
    from its config alone (built on the meta device: no weights read), as the engine names them."""
    from engine.lora import adaptable, in_out

    hf_config = read_config(config, model_dir)
    cls = auto_class(model_head(hf_config))
    quiet_transformers()
    with torch.device("meta"):
        model = cls.from_config(hf_config, trust_remote_code=config.trust_remote_code)
    return {name: in_out(m) for name, m in adaptable(model).items()}
