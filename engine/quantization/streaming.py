"""Quantize while loading: the model is built with its parameters on the meta device (no memory),
then its safetensors are read one tensor at a time, and each linear layer is quantized as soon as
its weight is read. The full-precision model never exists, on the device or on the host: at most
one layer's weight in its checkpoint dtype (plus its float32 copy while it is rounded) is held
beside the quantized layers.

The files are read with plain reads into each tensor's own buffer, not memory-mapped: a mapped
file's pages count in the process's resident memory until the kernel evicts them, so a mapped
checkpoint would be resident as a whole by the end of the load.

A checkpoint whose tensor names are not the model's own (a layout transformers converts while it
loads: fused or renamed projections, MoE experts stacked at load) is loaded the usual way, whole,
and quantized after; the engine says so once.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import mmap
import struct
import sys
from pathlib import Path

import torch
from torch import nn

from engine.quantization.checkpoints import PackedFormat

log = logging.getLogger(__name__)

MAPPED_BYTES = 1 << 20
"""A tensor of at least this size is read into anonymous memory of its own, not the heap: freed
once quantized, its pages go back at once. In the heap, the holes the float weights leave behind
are not always reused by the next layer's, and the resident memory grows by several layers'
worth over a load (measured: 8-11 MiB per layer of builtin:llama-42m for 3 MiB of int8 weights)."""
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _libc_trim():
    """glibc's malloc_trim, or None (not Linux, not glibc)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _libc_trim()


def give_back_heap() -> None:
    """Returns the heap's free pages to the system (glibc's malloc_trim). After each layer the
    loader quantizes: its float temporaries (the weight read, the rounded copy) come from the heap,
    which a CPU engine keeps (its trim threshold raised, engine.runner.memory.keep_cpu_buffers),
    and the holes they left between the quantized layers grew the resident memory by several
    MiB over a load (measured: 4-14 MiB on a 4-layer model with 12 MiB of int8 weights)."""
    if _TRIM is not None:
        _TRIM(0)


class SafetensorsFiles:
    """The tensors of a checkpoint's safetensors files, each read on demand with plain reads."""

    def __init__(self, model_dir: Path):
        self.entries: dict[str, tuple[Path, dict, int]] = {}
        """Tensor name -> (file, header entry, offset of the file's data)."""
        paths = sorted(Path(model_dir).glob("*.safetensors"))
        if not paths:
            raise FileNotFoundError(f"no safetensors files in {model_dir}")
        for path in paths:
            with open(path, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
            for name, entry in header.items():
                if name != "__metadata__":
                    self.entries[name] = (path, entry, 8 + size)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name][1]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return _dtype(name, self.entries[name][1])

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name`, read into a new CPU buffer of its own."""
        path, entry, base = self.entries[name]
        start, end = entry["data_offsets"]
        dtype = _dtype(name, entry)
        if end == start:
            return torch.empty(entry["shape"], dtype=dtype)
        return _read(path, base + start, end - start, name).view(dtype).reshape(entry["shape"])

    def slice(self, name: str) -> "TensorSlice":
        """The tensor `name` as safetensors' `get_slice` gives it: indexing reads only what it keeps."""
        return TensorSlice(self, name)


class TensorSlice:
    """One tensor of SafetensorsFiles, read in part: `[index]` (slices of step 1, as a tensor-parallel
    rank cuts its part) reads only the rows along the first axis that the index keeps. When it
    also cuts another axis, it reads those rows SLICE_BLOCK bytes at a time and keeps each block's
    cut, so a rank never holds the whole tensor."""

    def __init__(self, files: SafetensorsFiles, name: str):
        self.path, entry, base = files.entries[name]
        self.name, self.shape = name, list(entry["shape"])
        self.dtype = _dtype(name, entry)
        self.offset = base + entry["data_offsets"][0]

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        index += (slice(None),) * (len(self.shape) - len(index))
        if not self.shape or any(not isinstance(i, slice) or i.step not in (None, 1) for i in index):
            raise ValueError(f"{self.name}: only slices of step 1 are read in part, not {index}")
        first, rest = range(*index[0].indices(self.shape[0])), index[1:]
        row_bytes = self.dtype.itemsize * torch.Size(self.shape[1:]).numel()
        if not len(first) or not row_bytes:
            return torch.empty(0, dtype=self.dtype).reshape(len(first), *self.shape[1:])[(slice(None), *rest)]
        if all(i == slice(None) for i in rest):
            return self._rows(first.start, first.stop, row_bytes)
        step, out = max(1, SLICE_BLOCK // row_bytes), None
        for r in range(first.start, first.stop, step):
            part = self._rows(r, min(r + step, first.stop), row_bytes)[(slice(None), *rest)]
            if out is None:
                out = torch.empty((len(first), *part.shape[1:]), dtype=self.dtype)
            out[r - first.start:r - first.start + part.shape[0]] = part
        return out

    def _rows(self, start: int, stop: int, row_bytes: int) -> torch.Tensor:
        data = _read(self.path, self.offset + start * row_bytes, (stop - start) * row_bytes, self.name)
        return data.view(self.dtype).reshape(stop - start, *self.shape[1:])


SLICE_BLOCK = 1 << 20
"""Bytes of rows a TensorSlice reads at a time when it keeps only some of each row's columns."""


def _dtype(name: str, entry: dict) -> torch.dtype:
    dtype = DTYPES.get(entry["dtype"])
    if dtype is None:
        raise ValueError(f"{name}: safetensors dtype {entry['dtype']} is not supported")
    return dtype


def _read(path: Path, offset: int, size: int, name: str) -> torch.Tensor:
    """`size` bytes of `path` from `offset`, uint8, in a new buffer of their own."""
    if size >= MAPPED_BYTES:  # its own pages: given back to the system the moment it is freed
        buffer = torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8)
    else:
        buffer = torch.empty(size, dtype=torch.uint8)
    with open(path, "rb") as f:
        f.seek(offset)
        if f.readinto(memoryview(buffer.numpy())) != size:
            raise ValueError(f"{name}: {path.name} ends before the tensor does")
    return buffer


@contextlib.contextmanager
def parameters_on_meta():
    """Modules built inside get their parameters on the meta device (no memory); buffers stay
    real, so those computed at construction (rotary frequencies) are right."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def build_on_meta(cls, hf_config, dtype: torch.dtype, attn_implementation: str, trust_remote_code: bool):
    """The model class `cls` from its config, its parameters on the meta device."""
    with parameters_on_meta():
        return cls.from_config(hf_config, dtype=dtype, attn_implementation=attn_implementation,
                               trust_remote_code=trust_remote_code)


def _check_unquantized(packed, files, module: str) -> None:
    """A layer of a quantized checkpoint that its format does not hold must be stored in floating
    point: int8 or fp8 values without their scales are refused, naming the missing tensor."""
    name = f"{module}.weight"
    if name in files and (not files.dtype(name).is_floating_point or files.dtype(name).itemsize == 1):
        raise ValueError(f"{module}.{packed.tensors[0]}: missing from the checkpoint (its {name} is "
                         f"{str(files.dtype(name)).removeprefix('torch.')})")


def names_match(model: nn.Module, files: SafetensorsFiles, tied: bool, packed=None) -> bool:
    """Whether every parameter of the model is a tensor of the checkpoint under its own name (a
    linear layer a quantized checkpoint's format `packed` holds, by that format's tensors)."""
    head_weight = getattr(model.get_output_embeddings(), "weight", None)
    return all(name in files or (tied and param is head_weight)
               or (packed is not None and packed.owns(files, name.rsplit(".", 1)[0]))
               for name, param in model.named_parameters())


def stream_weights(model: nn.Module, files: SafetensorsFiles, device: torch.device, dtype: torch.dtype,
                   method: str, tied: bool, packed=None) -> int:
    """Fills the meta model from `files`: every linear layer engine.quantization.methods.quantizer
    picks is replaced by its quantized module as its weight is read (a tied head from the input
    embedding's tensor); every other parameter is read into `device`, floating ones in `dtype`.
    With a quantized checkpoint's format `packed` (engine.quantization.checkpoints), the layers it
    holds load from its tensors instead, and the others (the LM head its config ignores, a layer
    no group divides) stay as stored, as vLLM runs them. Returns how many layers were quantized."""
    from transformers.pytorch_utils import Conv1D

    from engine.quantization.methods import quantizer

    head = model.get_output_embeddings()
    embedding = model.get_input_embeddings()
    embedding_name = next((n for n, p in model.named_parameters() if embedding is not None and p is embedding.weight),
                          None)
    count = 0
    with torch.no_grad():
        for parent_name, parent in list(model.named_modules()):
            for child_name, child in list(parent.named_children()):
                if not isinstance(child, (nn.Linear, Conv1D)):
                    continue
                name = f"{parent_name}.{child_name}" if parent_name else child_name
                if packed is not None and packed.owns(files, name):
                    setattr(parent, child_name, _repacked(packed, files, name, child, dtype, device, method))
                    give_back_heap()
                    count += 1
                    continue
                if packed is not None:  # a layer the checkpoint left unquantized stays as stored
                    _check_unquantized(packed, files, name)
                    continue
                make = quantizer(method, child_name, child, head, dtype, device)
                source = f"{name}.weight"
                if source not in files and tied and child is head:
                    source = embedding_name
                if make is None or source not in files:
                    continue
                weight = files.get(source)
                weight = weight.T if isinstance(child, Conv1D) else weight  # GPT-2 stores (in, out)
                bias = files.get(f"{name}.bias") if child.bias is not None else None
                setattr(parent, child_name, make(weight, bias))
                del weight, bias
                give_back_heap()
                count += 1
        head = model.get_output_embeddings()  # (the quantized one, when it was)
        for module_name, module in list(model.named_modules()):
            for leaf, param in list(module._parameters.items()):
                if param is None or not param.is_meta:
                    continue
                name = f"{module_name}.{leaf}" if module_name else leaf
                if name not in files:
                    if tied and module is head:
                        continue  # tied below
                    raise ValueError(f"no tensor {name} in the safetensors files")
                t = files.get(name)
                if tuple(t.shape) != tuple(param.shape):
                    raise ValueError(f"{name}: the checkpoint holds {tuple(t.shape)}, the model {tuple(param.shape)}")
                t = t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
                module._parameters[leaf] = nn.Parameter(t, requires_grad=False)
        if tied and head is not None and isinstance(getattr(head, "weight", None), nn.Parameter) and head.weight.is_meta:
            head.weight = model.get_input_embeddings().weight
    for buffer_owner in model.modules():  # buffers computed at construction, on the host
        for leaf, buf in list(buffer_owner._buffers.items()):
            if buf is not None and buf.device != device and not buf.is_meta:
                buffer_owner._buffers[leaf] = buf.to(device)
    return count


def _repacked(packed, files: SafetensorsFiles, name: str, child: nn.Module, dtype: torch.dtype,
              device: torch.device, method: str) -> nn.Module:
    """Linear layer `name` of a quantized checkpoint as stored: an 8-bit one's values and scales
    into the int8 or fp8 kernels (an fp8 one running `method` int8 requantized, this layer alone);
    a 4-bit one in the int4 kernels' layout, or, a shape they do not take, in `dtype`."""
    from engine.quantization.int4 import Int4Linear, int4_supported
    from engine.quantization.methods import FP8_MAX, Fp8Linear, Int8Linear

    n, k = child.out_features, child.in_features
    bias = files.get(f"{name}.bias") if f"{name}.bias" in files else None
    if not isinstance(packed, PackedFormat):  # an 8-bit ScaledFormat
        values, scale = packed.read(files, name, n, k)
        inputs = packed.input_scale(files, name)
        if packed.kind == method:
            return (Int8Linear if method == "int8" else Fp8Linear)(values, bias, dtype, scale=scale,
                                                                   input_scale=inputs).to(device)
        if inputs is not None:  # an fp8 range's scale as int8's: x / s within +-448 is x / s' within +-127
            inputs *= FP8_MAX / 127.0
        return Int8Linear(values.float() * scale[:, None], bias, dtype, input_scale=inputs).to(device)
    q, scale, zero = packed.read(files, name, n, k)
    if int4_supported(n, k, device, packed.group_size):
        return Int4Linear(q, scale, zero, bias, dtype, device, packed.group_size)
    g = packed.group_size
    weight = ((q.float() - 8).view(n, k // g, g) * scale[..., None] + zero[..., None]).view(n, k)
    layer = nn.Linear(k, n, bias=bias is not None, device=device, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer


def load_quantized(cls, hf_config, model_dir: Path, method: str, dtype: torch.dtype, device: torch.device,
                   attn_implementation: str, trust_remote_code: bool, packed=None, wrap=None, adapt=None):
    """The model of class `cls`, its linear layers quantized with `method` as they are read;
    (model, what its weights would hold unquantized in `dtype`), or None where the checkpoint's
    tensor names are not the model's own (the caller loads it whole). `wrap(files)`: the tensors
    to read instead of the model_dir's safetensors files (a tensor-parallel rank's slices of them);
    `adapt(model)` changes the model built on meta before it is filled (a rank without the LM head)."""
    try:
        files = SafetensorsFiles(model_dir)
    except FileNotFoundError:
        return None
    if wrap is not None:
        files = wrap(files)
    model = build_on_meta(cls, hf_config, dtype, attn_implementation, trust_remote_code)
    if adapt is not None:
        adapt(model)
    tied = bool(getattr(hf_config.get_text_config(decoder=True), "tie_word_embeddings", False)
                or getattr(hf_config, "tie_word_embeddings", False))
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if (tied and getattr(head, "weight", None) is not None and embedding is not None
            and head.weight.shape == embedding.weight.shape):
        head.weight = embedding.weight  # one tensor, as the loaded model holds it
    if packed is not None and not any(packed.owns(files, n) for n, _ in model.named_modules()):
        raise ValueError(f"the config says {packed.name}, but no layer holds its tensors (no *.{packed.tensors[0]})")
    if not names_match(model, files, tied, packed):
        missing = next(n for n, _ in model.named_parameters() if n not in files)
        if isinstance(packed, PackedFormat):  # 4-bit layers: nothing else reads them
            raise ValueError(f"no tensor {missing} in the {packed.name} checkpoint")
        log.info("%s: the checkpoint's tensor names are not the model's (no %s): loading it whole, then quantizing",
                 model_dir, missing)
        return None
    unquantized = sum(p.numel() * (dtype.itemsize if p.is_floating_point() else p.element_size())
                                           for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers())  # as weights_nbytes counts them
    stream_weights(model, files, device, dtype, method, tied, packed)
    if (Path(model_dir) / "generation_config.json").exists():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    return model.eval(), unquantized

