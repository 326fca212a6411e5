"""What a GGUF file (llama.cpp's single-file format) holds, read without its tensor data: the
metadata, the tensor table, and the one-line refusal of a file that is not GGUF, is cut short, or
holds an architecture or tensor type the engine does not read (engine.models.gguf converts it)."""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from engine.api.errors import ModelLoadError, one_line

MAGIC = b"GGUF"
ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
"""GGUF `general.architecture` values the engine reads (Mistral files say `llama`)."""
FLOAT_TYPES = {0: "F32", 1: "F16", 30: "BF16"}
QUANT_TYPES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K",
               13: "Q5_K", 14: "Q6_K"}
"""ggml type id -> name of every tensor type read (block types dequantized with the `gguf` package)."""
BLOCKS = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 10: (256, 84), 11: (256, 110),
          12: (256, 144), 13: (256, 176), 14: (256, 210)}
"""ggml type id -> (values, bytes) of one block."""
ITEM_BYTES = {0: 4, 1: 2, 30: 2}
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_KEEP_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                "tokenizer.ggml.scores")


@dataclass
class TensorEntry:
    name: str
    """The tensor's GGUF name (`blk.0.attn_q.weight`)."""
    shape: tuple[int, ...]
    """In torch order (rows first): the reverse of ggml's."""
    ggml_type: int
    """ggml's type id (FLOAT_TYPES, QUANT_TYPES)."""
    offset: int
    """Of its data, from the file's start."""
    nbytes: int
    """Of its data in the file."""


@dataclass
class GGUFHeader:
    """A GGUF file's metadata and tensor table: everything but the tensors' data."""

    path: Path
    architecture: str
    """`general.architecture`."""
    metadata: dict = field(repr=False)
    """Every key: scalars and strings as values, arrays of numbers as lists, string arrays as a
    count except the tokenizer's (tokens, merges), which are kept."""
    tensors: list[TensorEntry] = field(repr=False)

    def tensor_types(self) -> dict[str, int]:
        """Type name -> how many tensors of it (`{"Q4_1": 210, "F32": 61, "Q8_0": 1}`)."""
        counts: dict[str, int] = {}
        for t in self.tensors:
            name = FLOAT_TYPES.get(t.ggml_type) or QUANT_TYPES.get(t.ggml_type) or f"type {t.ggml_type}"
            counts[name] = counts.get(name, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: -kv[1]))

    @property
    def has_tokenizer(self) -> bool:
        return "tokenizer.ggml.tokens" in self.metadata and "tokenizer.ggml.model" in self.metadata


def is_gguf_file(ref: str) -> bool:
    return ref.split("?")[0].lower().endswith(".gguf")


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """The header of a GGUF file, read without its tensor data; refuses in one line naming the
    file what is not a GGUF file, is cut short, or holds an architecture or tensor type we do not read."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise ModelLoadError(f"{path}: not a GGUF file ({size} bytes)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
                header = _parse(blob, path, size)
    except OSError as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {one_line(exc)}") from exc
    if header.architecture not in ARCHITECTURES:
        raise ModelLoadError(f"{path}: GGUF architecture {header.architecture!r} is not supported; the engine reads "
                             f"{', '.join(ARCHITECTURES)}")
    unknown = sorted({t.ggml_type for t in header.tensors} - set(FLOAT_TYPES) - set(QUANT_TYPES))
    if unknown:
        bad = next(t for t in header.tensors if t.ggml_type == unknown[0])
        raise ModelLoadError(f"{path}: tensor {bad.name} has ggml type {_type_name(unknown[0])}, which is not read; "
                             f"supported: {', '.join(list(FLOAT_TYPES.values()) + list(QUANT_TYPES.values()))}")
    return header


def _type_name(type_id: int) -> str:
    try:
        from gguf import GGMLQuantizationType

        return f"{GGMLQuantizationType(type_id).name} ({type_id})"
    except (ImportError, ValueError):
        return str(type_id)


def _parse(blob, path: Path, size: int) -> GGUFHeader:
    if blob[:4] != MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (it does not start with the bytes 'GGUF')")
    pos = 4
    cut = f"{path}: truncated GGUF file (its header runs past the end, {size} bytes)"

    def take(fmt: str):
        nonlocal pos
        width = struct.calcsize(fmt)
        if pos + width > size:
            raise ModelLoadError(cut)
        value = struct.unpack_from(fmt, blob, pos)
        pos += width
        return value if len(value) > 1 else value[0]

    def string() -> str:
        nonlocal pos
        length = take("<Q")
        if pos + length > size:
            raise ModelLoadError(cut)
        text = blob[pos:pos + length].decode("utf-8", errors="replace")
        pos += length
        return text

    def value(kind: int, keep: bool):
        nonlocal pos
        if kind in _SCALARS:
            return take(_SCALARS[kind])
        if kind == 8:
            return string()
        if kind == 9:
            inner, count = take("<I"), take("<Q")
            if inner in _SCALARS:
                width = struct.calcsize(_SCALARS[inner])
                if pos + width * count > size:
                    raise ModelLoadError(cut)
                values = list(struct.unpack_from(f"<{count}{_SCALARS[inner][1]}", blob, pos))
                pos += width * count
                return values
            if inner == 8:
                if keep:
                    return [string() for _ in range(count)]
                for _ in range(count):
                    pos += 8 + take("<Q")
                return count
            raise ModelLoadError(f"{path}: metadata holds an array of type {inner}, which is not a GGUF type")
        raise ModelLoadError(f"{path}: metadata holds a value of type {kind}, which is not a GGUF type")

    version = take("<I")
    if version not in (2, 3):
        raise ModelLoadError(f"{path}: GGUF version {version} is not read (2 and 3 are)")
    n_tensors, n_keys = take("<Q"), take("<Q")
    metadata: dict = {}
    for _ in range(n_keys):
        key = string()
        metadata[key] = value(take("<I"), key in _KEEP_ARRAYS)
    raw = []
    for _ in range(n_tensors):
        name = string()
        dims = [take("<Q") for _ in range(take("<I"))]
        kind, offset = take("<I"), take("<Q")
        raw.append((name, tuple(reversed(dims)), kind, offset))
    align = metadata.get("general.alignment", 32)
    if isinstance(align, bool) or not isinstance(align, int) or not 0 < align <= 1 << 20:
        # llama.cpp requires a power of two; 0 divided by zero here, text raised ValueError
        raise ModelLoadError(f"{path}: general.alignment is {align!r}; a GGUF file's alignment is a positive "
                             "power of two (32 by default)")
    if align & (align - 1):
        raise ModelLoadError(f"{path}: general.alignment is {align}, not a power of two")
    data_start = (pos + align - 1) // align * align
    if "general.architecture" not in metadata:
        raise ModelLoadError(f"{path}: GGUF metadata has no general.architecture")
    tensors = []
    for name, shape, kind, offset in raw:
        elements = 1
        for d in shape:
            elements *= d
        if kind in ITEM_BYTES:
            nbytes = elements * ITEM_BYTES[kind]
        elif kind in BLOCKS:
            nbytes = elements // BLOCKS[kind][0] * BLOCKS[kind][1]
        else:
            nbytes = 0  # refused by read_header, which names the type
        tensors.append(TensorEntry(name, shape, kind, data_start + offset, nbytes))
    end = max((t.offset + t.nbytes for t in tensors), default=data_start)
    if end > size:
        cut = next(t for t in tensors if t.offset + t.nbytes > size)
        raise ModelLoadError(f"{path}: truncated GGUF file: tensor {cut.name} ends at byte {cut.offset + cut.nbytes}, "
                             f"the file at {size}")
    return GGUFHeader(path, str(metadata["general.architecture"]), metadata, tensors)
