"""int4 weights (weight-only, W4A16): 4-bit values in groups of 128 along the input, one scale and
one zero point per group, run through torch's packed int4 kernels.

On CPU, `torch._weight_int4pack_mm_for_cpu`; on CUDA, `torch._weight_int4pack_mm` (tinygemm).
Both compute in bfloat16: a float32 model's activations are cast for the product and back. What
was measured on this 2-core CPU at (N, K) = (1536, 512), group 128, one thread: with bfloat16
activations the int4 product takes 46 / 152 / 1175 us at 1 / 8 / 64 rows against float32's
70 / 232 / 1083 us; with float32 activations the same kernel takes 1331 / 10821 / 87578 us (its
float32 path is scalar). torch's weight-only int8 kernel (`_weight_int8pack_mm`) behaves the same:
47 / 195 / 1424 us with bfloat16 activations, 783 / 5267 / 49958 us with float32 ones. That is
the op and the shapes behind "10-20x slower": it is the float32 activations, not the kernel.

Values are stored as torch's kernels want them: w = (q - 8) * scale + zero with q in [0, 15], and
scales and zeros together as (K / group, N, 2) in bfloat16. A layer whose shape the kernels do not
take (CPU: N a multiple of 16; CUDA: N of 8) stays in the model's dtype.

Quantized while loading, a layer whose K is not a multiple of the group (down_proj's 1,376 inputs
in builtin:llama-42m; every projection of a model 576 or 960 wide, as SmolLM's) is padded to the
next multiple: its last group repeats its last column (so the group's range is its own), and
each forward pads the activations with zeros, which the padded columns multiply. Before, such a
layer stayed in the model's dtype. A checkpoint's layers are taken as stored.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.quantization.rounding import row_chunks

GROUP_SIZE = 128
"""Input columns that share one scale and zero point (vLLM's and GPTQ's usual group)."""
CUDA_INNER_K_TILES = 8


def int4_supported(out_features: int, in_features: int, device: torch.device, group_size: int = GROUP_SIZE,
                   pad: bool = False) -> bool:
    """Whether the packed kernels take a layer of this shape on `device` (with `pad`, its inputs
    padded to a multiple of the group, as from_weight does)."""
    if pad:
        in_features = padded(in_features, group_size)
    if in_features % group_size:
        return False
    if device.type == "cuda":
        return out_features % 8 == 0 and in_features % (CUDA_INNER_K_TILES * 16) == 0
    return out_features % 16 == 0 and in_features % 2 == 0


def padded(in_features: int, group_size: int = GROUP_SIZE) -> int:
    """`in_features` rounded up to a multiple of the group."""
    return -(-in_features // group_size) * group_size


def quantize_int4(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric per-group rounding of `weight` (N, K) -> (q (N, K) uint8 in [0, 15], scale and
    zero (N, K / group) float32, in torch's convention w = (q - 8) * scale + zero)."""
    n, k = weight.shape
    w = weight.detach().reshape(n, k // group_size, group_size)
    low, high = w.amin(dim=-1).float(), w.amax(dim=-1).float()
    scale = ((high - low) / 15).clamp(min=1e-8)
    q = torch.empty((n, k // group_size, group_size), dtype=torch.uint8, device=weight.device)
    for rows in row_chunks(weight):  # a float32 temporary of 1 MiB, never one of the whole matrix
        q[rows] = (w[rows].float() - low[rows, :, None]).div_(scale[rows, :, None]).round_().clamp_(0, 15)
    return q.reshape(n, k), scale, low + 8 * scale


CPU_PACK_ROWS = 64
"""The CPU packing works on blocks of 64 output rows: packed apart, they are packed the same."""


def _pack_cpu(q: torch.Tensor) -> torch.Tensor:
    """torch's CPU int4 layout of q (N, K) uint8, converted a block of rows at a time: the kernel
    takes int32 values, which a whole layer would hold at 4 bytes each."""
    n, k = q.shape
    if n % CPU_PACK_ROWS:
        return torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    step = max(1, (1 << 18) // (k * CPU_PACK_ROWS)) * CPU_PACK_ROWS
    return torch.cat([torch._convert_weight_to_int4pack_for_cpu(q[i:i + step].to(torch.int32), 1)
                      for i in range(0, n, step)])


class Int4Linear(nn.Module):
    """y = x W^T + b with W as packed 4-bit values, a bfloat16 scale and zero point per group."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype, device: torch.device, group_size: int = GROUP_SIZE):
        """`q` (N, K) int in [0, 15] and `scale`, `zero` (N, K / group) as quantize_int4 gives them
        (a checkpoint's values are converted to that convention first)."""
        super().__init__()
        n, k = q.shape
        if scale.shape != (n, k // group_size) or zero.shape != scale.shape:
            raise ValueError(f"int4 scales {tuple(scale.shape)} and zeros {tuple(zero.shape)} do not fit a "
                             f"({n}, {k}) weight in groups of {group_size}")
        q = q.to(device=device, dtype=torch.uint8).contiguous()
        if device.type == "cuda":
            packed = torch._convert_weight_to_int4pack(q[:, ::2] << 4 | q[:, 1::2], CUDA_INNER_K_TILES)
        else:
            packed = _pack_cpu(q)
        self.register_buffer("qweight", packed)
        self.register_buffer("scales_and_zeros", torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
                             .to(device=device, dtype=torch.bfloat16))
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(device=device, dtype=dtype),
                                                           requires_grad=False)
        self.in_features, self.out_features, self.group_size = k, n, group_size
        self.qweight_in = k
        """The inputs the packed values hold (in_features, or more where from_weight padded them)."""

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                    device: torch.device, group_size: int = GROUP_SIZE) -> "Int4Linear":
        """`weight` (N, K) quantized in groups along K; K padded to a multiple of the group (its
        last column repeated, so the last group's range is its own)."""
        n, k = weight.shape
        if k % group_size:
            weight = torch.cat([weight, weight[:, -1:].expand(n, padded(k, group_size) - k)], dim=1)
        q, scale, zero = quantize_int4(weight, group_size)
        layer = cls(q, scale, zero, bias, dtype, device, group_size)
        layer.in_features = k
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        if self.in_features != self.qweight_in:  # zeros for the padded columns
            x2 = torch.nn.functional.pad(x2, (0, self.qweight_in - self.in_features))
        if x2.device.type == "cuda":
            y = torch._weight_int4pack_mm(x2, self.qweight, self.group_size, self.scales_and_zeros)
        else:
            y = torch._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group_size, self.scales_and_zeros)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight these values stand for, (N, K) float32 (the identity through the kernel)."""
        eye = torch.eye(self.qweight_in, device=self.qweight.device, dtype=torch.bfloat16)
        if self.qweight.device.type == "cuda":
            full = torch._weight_int4pack_mm(eye, self.qweight, self.group_size, self.scales_and_zeros)
        else:
            full = torch._weight_int4pack_mm_for_cpu(eye, self.qweight, self.group_size, self.scales_and_zeros)
        return full.float().T[:, :self.in_features]
