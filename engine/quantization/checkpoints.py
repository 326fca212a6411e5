"""4-bit checkpoints run as stored: GPTQ (4 bits, `desc_act` false), AWQ (GEMM) and
compressed-tensors `pack-quantized` W4A16, detected from config.json's `quantization_config` and
repacked at load, layer by layer, into the int4 kernels' layout (engine.quantization.int4): never
dequantized to full precision as a whole.

Each format's layout, as its writers document it (K inputs, N outputs, G the group size):
- GPTQ: `qweight` int32 (K/8, N), eight 4-bit values packed along K (value k at bits 4*(k%8));
  `qzeros` int32 (K/G, N/8), packed along N the same way; `scales` float16 (K/G, N); `g_idx` (K,).
  w = scale * (q - z), where checkpoint_format "gptq" (v1, the usual) stores z - 1.
- AWQ (GEMM): `qweight` int32 (K, N/8) and `qzeros` int32 (K/G, N/8), eight values packed along N
  in the order 0, 2, 4, 6, 1, 3, 5, 7 (nibble i holds column 8c + order[i]); `scales` float16
  (K/G, N). w = scale * (q - z).
- compressed-tensors pack-quantized, symmetric (llm-compressor's W4A16): `weight_packed` int32
  (N, K/8), packed along K (value k at bits 4*(k%8)), of the signed values + 8; `weight_scale`
  (N, K/G). w = scale * (q - 8). (An asymmetric scheme's zero points are refused.)

In the kernels' convention w = (q - 8) * scale + zero with q in [0, 15]: zero = scale * (8 - z)
for GPTQ's and AWQ's z, and 0 for compressed-tensors.

8-bit compressed-tensors checkpoints (ScaledFormat) load as stored too: `int-quantized` W8A8 and
`float-quantized` FP8 keep each layer's `weight` int8 or float8 e4m3 (N, K) with its symmetric
`weight_scale`, one per output channel (N, 1) or one for the tensor (1,): w = weight * scale.
Activations are quantized per token on the fly where the scheme is dynamic; a static one's
per-tensor `input_scale` (calibrated when the checkpoint was written) quantizes them as stored.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""The column of each nibble of an AWQ int32: nibble i holds column 8c + AWQ_ORDER[i]."""


def nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """The 4-bit values of int32s holding eight each (value i at bits 4i), unpacked along `dim`."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    p = packed.to(torch.int32)
    if dim == 0:
        return ((p[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(-1, p.shape[1]).to(torch.uint8)
    return ((p[:, :, None] >> shifts[None, None, :]) & 0xF).reshape(p.shape[0], -1).to(torch.uint8)


@dataclass(frozen=True)
class PackedFormat:
    """A 4-bit checkpoint format: its name, the tensors of a linear layer, and how to read them."""

    name: str
    group_size: int
    tensors: tuple[str, ...]
    """Suffixes of a quantized linear layer's tensors (the first one marks the layer as quantized)."""
    zero_offset: int = 0
    """GPTQ v1 stores each zero point minus 1."""

    def owns(self, files, module: str) -> bool:
        return f"{module}.{self.tensors[0]}" in files

    def layout(self, suffix: str):
        """A tensor's (output axis, outputs per stored element, input axis, inputs per stored
        element), as tensor parallelism cuts it (engine.distributed.tensor_parallel.ShardedFiles)."""
        g = self.group_size
        return {"gptq": {"qweight": (1, 1, 0, 8), "qzeros": (1, 8, 0, g), "scales": (1, 1, 0, g),
                         "g_idx": (None, 1, 0, 1)},
                "awq": {"qweight": (1, 8, 0, 1), "qzeros": (1, 8, 0, g), "scales": (1, 1, 0, g)},
                "compressed-tensors": {"weight_packed": (0, 1, 1, 8), "weight_scale": (0, 1, 1, g),
                                       "weight_shape": (None, 1, None, 1)}}[self.name].get(suffix)

    def read(self, files, module: str, out_features: int, in_features: int):
        """(q (N, K) uint8 in [0, 15], scale, zero (N, K / G) float32) in the kernels' convention;
        ValueError naming the tensor when one is missing or misshapen."""
        n, k, g = out_features, in_features, self.group_size
        if k % g:
            ranks = getattr(files, "n", 1)  # a tensor-parallel rank's slices (ShardedFiles) hold 1/n of K
            share = f" (each of {ranks} tensor-parallel ranks holds {k} of its {k * ranks})" if ranks > 1 else ""
            raise ValueError(f"{module}: group size {g} does not divide its {k} input features{share}")
        get = _getter(files, module)
        if self.name == "compressed-tensors":
            q = nibbles(get("weight_packed", (n, k // 8)), dim=1)
            scale = get("weight_scale", (n, k // g)).float()
            return q, scale, torch.zeros_like(scale)  # symmetric: w = scale * (q - 8)
        scale = get("scales", (k // g, n)).float().T.contiguous()
        if self.name == "gptq":
            g_idx = f"{module}.g_idx"
            order = files.get(g_idx).long() if g_idx in files else None  # (a shard's starts past 0)
            if order is not None and not torch.equal(order - order[:1], torch.arange(k) // g):
                raise ValueError(f"{g_idx}: the groups are not in order (desc_act); only desc_act false runs")
            q = nibbles(get("qweight", (k // 8, n)), dim=0).T.contiguous()
            z = nibbles(get("qzeros", (k // g, n // 8)), dim=1).float() + self.zero_offset
        else:  # awq: nibble i holds column order[i]
            order = torch.tensor(AWQ_ORDER)
            inverse = torch.argsort(order)
            q = _awq_columns(nibbles(get("qweight", (k, n // 8)), dim=1), inverse).T.contiguous()
            z = _awq_columns(nibbles(get("qzeros", (k // g, n // 8)), dim=1), inverse).float()
        return q, scale, (scale * (8 - z.T)).contiguous()


@dataclass(frozen=True)
class ScaledFormat:
    """An 8-bit compressed-tensors checkpoint: `kind` int8 (W8A8) or fp8."""

    name: str
    kind: str
    tensors: tuple[str, ...] = ("weight_scale", "weight")
    static_inputs: bool = False
    """The activations' scheme is static: each layer's `input_scale` (one for the tensor) is read."""

    def owns(self, files, module: str) -> bool:
        return f"{module}.weight_scale" in files

    def layout(self, suffix: str):
        """As PackedFormat.layout: values (N, K), a scale per output channel (N, 1) or tensor (1,)."""
        return {"weight": (0, 1, 1, 1), "weight_scale": (0, 1, None, 1), "input_scale": (None, 1, None, 1)}.get(suffix)

    def input_scale(self, files, module: str) -> float | None:
        """A static scheme's input scale of the layer (None for a dynamic scheme); ValueError naming
        the tensor when it is missing or not one value."""
        if not self.static_inputs:
            return None
        name = f"{module}.input_scale"
        if name not in files:
            raise ValueError(f"{name}: missing from the checkpoint (its activations' scheme is static)")
        scale = files.get(name)
        if scale.numel() != 1:
            raise ValueError(f"{name}: shape {tuple(scale.shape)}, expected one value (a static per-tensor scale)")
        return float(scale.float().reshape(()))

    def read(self, files, module: str, out_features: int, in_features: int):
        """(values (N, K) int8 or float8 e4m3, scale (N,) float32); ValueError naming the tensor
        when one is missing, misshapen or of another dtype."""
        get = _getter(files, module)
        values = get("weight", (out_features, in_features))
        want = torch.int8 if self.kind == "int8" else torch.float8_e4m3fn
        if values.dtype != want:
            raise ValueError(f"{module}.weight: {str(values.dtype).removeprefix('torch.')} values in a "
                             f"{self.name} checkpoint, expected {str(want).removeprefix('torch.')}")
        name = f"{module}.weight_scale"
        scale = files.get(name)
        if scale.numel() == 1:
            scale = scale.reshape(1).expand(out_features)
        elif tuple(scale.shape) in ((out_features, 1), (out_features,)):
            scale = scale.reshape(out_features)
        else:
            raise ValueError(f"{name}: shape {tuple(scale.shape)}, expected ({out_features}, 1) or (1,): "
                             "channel or tensor scales")
        return values, scale.float().contiguous()


def schemes(qc: dict, part: str = "weights") -> list[dict]:
    """A compressed-tensors quantization_config's schemes of `part` (weights, input_activations),
    one per config group ({} where a group has none)."""
    return [g.get(part) or {} for g in (qc.get("config_groups") or {}).values()]


def stored_format(qc: dict) -> PackedFormat | ScaledFormat:
    """How a quantized checkpoint's layers load as stored: 4-bit ones repacked (packed_format),
    8-bit compressed-tensors ones as they are. ValueError in one line for what cannot run."""
    if qc.get("quant_method") == "compressed-tensors":
        weights = schemes(qc)
        kinds = {(w.get("type"), w.get("num_bits")) for w in weights}
        if kinds in ({("int", 8)}, {("float", 8)}):
            kind = "int8" if kinds == {("int", 8)} else "fp8"
            for w in weights:
                if not w.get("symmetric", True):
                    raise ValueError(f"compressed-tensors {kind} checkpoint with asymmetric weights (zero points): "
                                     "only symmetric ones run")
                if w.get("strategy") not in ("channel", "tensor", None):
                    raise ValueError(f"compressed-tensors {kind} checkpoint with {w.get('strategy')} weight scales: "
                                     "only channel and tensor scales run")
            static = [a for a in schemes(qc, "input_activations") if a and not a.get("dynamic", True)]
            for a in static:
                if a.get("strategy") not in ("tensor", None) or not a.get("symmetric", True):
                    raise ValueError(f"compressed-tensors {kind} checkpoint with static {a.get('strategy')} "
                                     f"{'' if a.get('symmetric', True) else 'asymmetric '}input scales: only static "
                                     "symmetric tensor scales (or dynamic ones) run")
            return ScaledFormat(f"compressed-tensors {kind}", kind, static_inputs=bool(static))
    return packed_format(qc)


def _awq_columns(values: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """AWQ's nibbles (rows, N) in column order: within each block of eight, nibble i is column order[i]."""
    rows, n = values.shape
    return values.view(rows, n // 8, 8)[:, :, inverse].reshape(rows, n)


def _getter(files, module: str):
    def get(suffix: str, shape: tuple[int, ...]) -> torch.Tensor:
        name = f"{module}.{suffix}"
        if name not in files:
            raise ValueError(f"{name}: missing from the checkpoint")
        t = files.get(name)
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {shape}")
        return t
    return get


def packed_format(qc: dict) -> PackedFormat:
    """The format of a 4-bit checkpoint's quantization_config; ValueError in one line naming what
    cannot run (another bit width, desc_act, AWQ's other versions, ...)."""
    method = qc.get("quant_method")
    if method == "gptq":
        bits, desc = qc.get("bits"), qc.get("desc_act", False)
        if bits != 4:
            raise ValueError(f"GPTQ checkpoint with {bits}-bit weights: only 4-bit GPTQ runs")
        if desc:
            raise ValueError("GPTQ checkpoint with desc_act true (act-order groups): only desc_act false runs")
        offset = 0 if qc.get("checkpoint_format") == "gptq_v2" else 1
        return PackedFormat("gptq", int(qc.get("group_size") or 128), ("qweight", "qzeros", "scales"), offset)
    if method == "awq":
        bits, version = qc.get("bits", qc.get("w_bit")), str(qc.get("version", "gemm")).lower()
        if bits != 4:
            raise ValueError(f"AWQ checkpoint with {bits}-bit weights: only 4-bit AWQ runs")
        if version != "gemm":
            raise ValueError(f"AWQ checkpoint of version {version}: only the GEMM version runs")
        return PackedFormat("awq", int(qc.get("group_size", qc.get("q_group_size")) or 128),
                            ("qweight", "qzeros", "scales"))
    if method == "compressed-tensors":
        weights = schemes(qc)
        w = weights[0] if weights else {}
        if qc.get("format") != "pack-quantized" or w.get("num_bits") != 4 or w.get("type") != "int":
            raise ValueError("compressed-tensors checkpoint: of 4-bit weights only pack-quantized int4 runs")
        if w.get("strategy") not in ("group", None):
            raise ValueError(f"compressed-tensors int4 checkpoint with {w.get('strategy')} scales: only group scales run")
        if not w.get("symmetric", True):
            raise ValueError("compressed-tensors int4 checkpoint with asymmetric weights (zero points): only "
                             "symmetric ones run")
        return PackedFormat("compressed-tensors", int(w.get("group_size") or 128), ("weight_packed", "weight_scale"))
    raise ValueError(f"quantization method {method!r} is not supported")


def checkpoint_config(hf_config) -> dict:
    """config.json's quantization_config as a dict ({} for a plain checkpoint)."""
    qc = getattr(hf_config, "quantization_config", None) or {}
    return qc if isinstance(qc, dict) else qc.to_dict()

