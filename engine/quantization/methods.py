"""Quantized weights: int8 (per output channel; CPU and CUDA), int4 (weight-only, groups of 128;
engine.quantization.int4) and fp8 (e4m3 weights with per-channel scales and dynamic per-token
activation scales; CUDA, compute capability >= 8.9). Each linear layer is quantized as its
weight is read where the checkpoint allows (engine.quantization.streaming), else after loading.

Every linear layer of the decoder is replaced after loading; the embedding stays in the
model's dtype (a lookup reads one row per token, so it costs no bandwidth worth saving). The
LM head is quantized too with int8: it is the largest matrix a decode step reads, and its logits
stay within the tolerance the tests hold; int4 and fp8 keep the head in the model's dtype. MoE
routers stay in the model's dtype (a flipped expert choice changes more than a rounding).
"""
from __future__ import annotations

import logging
import os
import warnings

import torch
from torch import nn

from engine.quantization.rounding import row_chunks

log = logging.getLogger(__name__)

METHODS = ("int8", "int4", "fp8")
FP8_MAX = 448.0
"""Largest finite float8 e4m3 value."""


class Int8Linear(nn.Module):
    """y = x W^T + b with W stored as int8 (N, K) and one scale per output channel (N,).

    The activations are quantized too, per token and on the fly (W8A8 dynamic, as
    compressed-tensors' W8A8 checkpoints are meant to run), and the product runs in int8
    through `torch._int_mm`: oneDNN on CPU (2-8x faster than float32 at 8-64 rows here, where
    torch's weight-only int8 kernel `_weight_int8pack_mm` ran 10-20x slower than float32 with
    float32 activations), cuBLASLt's int8 GEMM on CUDA (compute capability >= 8.0; it takes more
    than 16 rows, so fewer are padded with zero rows), whose int32 result is scaled once: no
    per-forward dequantized copy of the weight. On an older card (or a checkpoint's layer whose
    sizes are not multiples of 8) the weights are converted on the fly (weight-only); quantized
    while loading, such a layer stays in the model's dtype (quantizer)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 scale: torch.Tensor | None = None, input_scale: float | None = None):
        """`weight` in float, quantized here; or, with `scale` (N,), int8 values as a checkpoint stores them.
        `input_scale`: a static scheme's one scale for the activations (None: per token, at run time)."""
        super().__init__()
        self.register_buffer("input_scale", None if input_scale is None else torch.tensor([[input_scale]]))
        w = weight.detach()
        if scale is not None:
            qweight, scale = w.to(torch.int8).contiguous(), scale.detach().float()
        else:
            scale = torch.maximum(w.amax(dim=1), -w.amin(dim=1)).float().clamp(min=1e-12) / 127.0  # no |w| copy
            qweight = torch.empty(w.shape, dtype=torch.int8, device=w.device)
            for rows in row_chunks(w):  # a float32 temporary of 1 MiB, never one of the whole matrix
                qweight[rows] = w[rows].float().div(scale[rows, None]).round_().clamp_(-127, 127)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.to(dtype))
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        self.in_features, self.out_features = w.shape[1], w.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.device.type == "cpu" and self.input_scale is None and cpu_int8_kernel() == "x86":
            y = self._x86(x2)
        elif int_mm_runs(x2.device, self.out_features, self.in_features):
            x_scale = (x2.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / 127.0  # (M, 1)
                       if self.input_scale is None else self.input_scale)
            xq = torch.round(x2.float() / x_scale).clamp(-127, 127).to(torch.int8)
            m = xq.shape[0]
            if xq.is_cuda and m <= CUDA_INT_MM_MIN_ROWS:  # zero rows up to 24, the next multiple of 8
                xq = nn.functional.pad(xq, (0, 0, 0, CUDA_INT_MM_MIN_ROWS + 8 - m))
            y = torch._int_mm(xq, self.qweight.T)[:m]
            y = (y.float() * (x_scale * self.scale.float())).to(x2.dtype)
        else:  # the portable path: int8 read, converted on the fly, scaled after the product
            y = (x2 @ self.qweight.to(x2.dtype).T) * self.scale.to(x2.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def _x86(self, x2: torch.Tensor) -> torch.Tensor:
        """torch's x86 quantized engine's dynamic int8 linear (fbgemm's AVX2 GEMM), per token as
        the _int_mm path: each row is divided by its largest |value| and a row holding +1 and -1
        is appended, so the kernel's dynamic per-tensor range is [-1, 1] whatever rows share the
        pass. Its activations have 7 bits (the reduced range: without VNNI, fbgemm's AVX2 kernel
        adds pairs of uint8 x int8 products in int16, which a full 8-bit range saturates;
        measured here: wrong outputs), a step of 2/127 against the per-token int8 step of 1/127."""
        packed = self.__dict__.get("_packed")
        if packed is None:
            packed = self._pack()
        scale = x2.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
        bounds = _BOUNDS.get(self.in_features)
        if bounds is None:
            bounds = _BOUNDS[self.in_features] = torch.zeros(1, self.in_features)
            bounds[0, 0], bounds[0, -1] = 1.0, -1.0
        y = torch.ops.quantized.linear_dynamic(torch.cat([x2.float() / scale, bounds]), packed, True)[:-1]
        return (y * scale).to(x2.dtype)

    def _pack(self):
        """The int8 weight in the x86 engine's packed layout; the plain copy is dropped
        (int8_weight() unpacks it), so the weights are held once."""
        engine = torch.backends.quantized.engine
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's quantized tensors are deprecated, their GEMMs not replaced
            scales = self.scale.double()
            qt = torch._make_per_channel_quantized_tensor(self.qweight, scales, torch.zeros_like(scales, dtype=torch.long),
                                                           0)
            try:
                torch.backends.quantized.engine = "x86"
                packed = torch.ops.quantized.linear_prepack(qt, None)
            finally:
                torch.backends.quantized.engine = engine
        self.__dict__["_packed"] = packed
        self._buffers["qweight"] = None
        return packed

    def int8_weight(self) -> torch.Tensor:
        """The int8 values (N, K), wherever they are held."""
        if self._buffers.get("qweight") is not None:
            return self.qweight
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.ops.quantized.linear_unpack(self.__dict__["_packed"])[0].int_repr()

    def dequantized(self) -> torch.Tensor:
        """The weight these int8 values and scales stand for, (N, K) float32."""
        return self.int8_weight().float() * self.scale.float()[:, None]


_BOUNDS: dict[int, torch.Tensor] = {}
"""in_features -> the row appended to the x86 engine's input (+1 and -1): its range, fixed."""
_CPU_INT8: list[str] = []


def cpu_int8_kernel() -> str:
    """Which int8 GEMM a CPU Int8Linear runs: `onednn` (torch._int_mm) where the CPU has VNNI or
    AMX int8, `x86` (torch's x86 quantized engine: fbgemm's AVX2 kernel) on other x86 CPUs with
    AVX2: there oneDNN's int8 GEMM measured 10-13x slower than float32 (an AVX2 EPYC, 2 threads,
    SmolLM2's shapes), the x86 engine's 1.1-1.7x faster. BATCHINFER_CPU_INT8=onednn|x86 chooses."""
    if not _CPU_INT8:
        chosen = os.environ.get("BATCHINFER_CPU_INT8", "").strip().lower()
        if chosen not in ("onednn", "x86"):
            try:
                with open("/proc/cpuinfo") as f:
                    flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
            except OSError:
                flags = []
            vnni = any(flag in flags for flag in ("avx512_vnni", "avx_vnni", "amx_int8"))
            x86 = "x86" in torch.backends.quantized.supported_engines and "avx2" in flags
            chosen = "x86" if x86 and not vnni else "onednn"
        _CPU_INT8.append(chosen)
        log.info("CPU int8 GEMM: %s", chosen)
    return _CPU_INT8[0]


CUDA_INT_MM_MIN_ROWS = 16
"""cuBLASLt's int8 GEMM (torch._int_mm on CUDA) takes more rows than this."""


def int_mm_runs(device: torch.device, out_features: int, in_features: int) -> bool:
    """Whether torch._int_mm computes an (M, K) x (K, N) int8 product on `device`: always on CPU;
    on CUDA from compute capability 8.0, with K and N multiples of 8."""
    if device.type == "cpu":
        return True
    return (device.type == "cuda" and out_features % 8 == 0 and in_features % 8 == 0
            and _capability(device) >= (8, 0))


def _capability(device: torch.device) -> tuple[int, int]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITIES:
        _CAPABILITIES[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITIES[index]


_CAPABILITIES: dict[int, tuple[int, int]] = {}


class Fp8Linear(nn.Module):
    """y = x W^T + b with W in float8 e4m3 and per-channel scales; x gets per-token scales."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 scale: torch.Tensor | None = None, input_scale: float | None = None):
        """`weight` in float, quantized here; or, with `scale` (N,), float8 values as a checkpoint stores them.
        `input_scale`: a static scheme's one scale for the activations (None: per token, at run time)."""
        super().__init__()
        self.register_buffer("input_scale", None if input_scale is None else torch.tensor([[input_scale]]))
        if scale is not None:
            self.register_buffer("qweight", weight.detach().to(torch.float8_e4m3fn).contiguous())
            scale = scale.detach().float()
        else:
            w = weight.detach().float().contiguous()
            scale = w.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX
            self.register_buffer("qweight", (w / scale[:, None]).to(torch.float8_e4m3fn))
        self.register_buffer("scale", scale[None, :].contiguous())  # (1, N) float32
        # the product comes out in bfloat16 (see forward), and a bias is added in the product's dtype
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.bfloat16), requires_grad=False)
        self.out_features, self.in_features = self.qweight.shape
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.input_scale is None:
            x_scale = x2.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX  # (M, 1)
        else:  # row-wise as the weight's scales are (the kernels take both alike)
            x_scale = self.input_scale.expand(x2.shape[0], 1).contiguous()
        xq = (x2.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        # Row-wise scales give a bfloat16 product only (torch's CUDA kernels below compute capability
        # 9.0 or cuBLAS 12.9, and CUTLASS's); a float16 or float32 model casts it.
        y = torch._scaled_mm(xq, self.qweight.T, scale_a=x_scale, scale_b=self.scale, out_dtype=torch.bfloat16,
                             bias=self.bias)
        return y.to(self.dtype).reshape(*shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight these float8 values and scales stand for, (N, K) float32."""
        return self.qweight.float() * self.scale.float().T


def checkpoint_method(hf_config) -> tuple[str | None, str | None]:
    """(the checkpoint's quantization method as named in its config, the engine method its
    weights load into), from config.json's quantization_config; (None, None) for a plain one.
    compressed-tensors int8 (W8A8) and fp8 checkpoints load their values and scales as stored into
    the int8 and fp8 kernels; 4-bit GPTQ, AWQ and compressed-tensors pack-quantized ones are
    repacked into int4 (engine.quantization.checkpoints). Anything else is a one-line ValueError
    naming it."""
    qc = getattr(hf_config, "quantization_config", None)
    if not qc:
        return None, None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    name = qc.get("quant_method", "unknown")
    if name == "compressed-tensors":
        from engine.quantization.checkpoints import schemes, stored_format

        kinds = {(w.get("type"), w.get("num_bits")) for w in schemes(qc)}
        if kinds in ({("int", 8)}, {("float", 8)}):

            fmt = stored_format(qc)  # a one-line ValueError for a scheme that cannot run
            return fmt.name, fmt.kind
        if kinds != {("int", 4)}:
            shown = ", ".join(f"{t}{b}" for t, b in sorted(kinds, key=str)) or "no weight scheme"
            raise ValueError(f"compressed-tensors checkpoint with {shown} weights is not supported "
                             "(int8, fp8 and pack-quantized int4 are)")
    from engine.quantization.checkpoints import packed_format

    fmt = packed_format(qc)  # a one-line ValueError for what cannot run
    return ("compressed-tensors int4" if fmt.name == "compressed-tensors" else fmt.name), "int4"


def resolve_method(configured: str | None, checkpoint: str | None, loads_as: str | None,
                   device: torch.device) -> str | None:
    """The method the engine runs: the configured one, else the checkpoint's; a one-line error
    when they disagree. An fp8 checkpoint on a device without fp8 runs int8 (with a warning)."""
    if checkpoint is not None and configured is not None and configured != loads_as:
        raise ValueError(f"quantization {configured} asked for, but the checkpoint is quantized with {checkpoint}")
    method = configured or loads_as
    if configured is None and method == "fp8" and not _has_fp8(device):
        import logging

        logging.getLogger(__name__).warning("fp8 checkpoint on %s: no fp8 matmuls here, running int8 weights", device)
        return "int8"
    return method


def _has_fp8(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def check_method(method: str | None, device: torch.device) -> None:
    """A one-line error for a method this device cannot run."""
    if method is None:
        return
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {METHODS} or null, got {method!r}")
    if method == "fp8" and not _has_fp8(device):
        where = "CPU" if device.type == "cpu" else (
            f"{torch.cuda.get_device_name(device)} (compute capability "
            f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))})" if device.type == "cuda" else device.type)
        raise ValueError(f"quantization fp8 needs a CUDA device of compute capability >= 8.9 (Ada, Hopper), not {where}")


def quantizer(method: str, leaf: str, child: nn.Module, head: nn.Module | None, dtype: torch.dtype,
              device: torch.device):
    """(weight, bias) -> the quantized module replacing linear layer `child` (named `leaf` in its
    parent), or None where it stays in the model's dtype: an MoE router, the LM head (but with
    int8), or a layer whose shape the method's kernels do not take on `device` (int4's; on CUDA,
    int8's GEMM wants sizes that are multiples of 8 and fp8's `_scaled_mm` multiples of 16: such a
    layer would otherwise convert its whole weight at every forward, or fail at the first)."""
    from transformers.pytorch_utils import Conv1D

    from engine.quantization.int4 import Int4Linear, int4_supported

    if leaf in ("gate", "router") and isinstance(child, nn.Linear) and child.out_features < 512:
        return None  # an MoE router: few outputs, and its choice is discrete
    if child is head and method != "int8":
        return None
    out_features, in_features = (child.weight.shape[::-1] if isinstance(child, Conv1D) else child.weight.shape)
    if method == "int4":
        if not int4_supported(out_features, in_features, device, pad=True):
            return None
        return lambda weight, bias: Int4Linear.from_weight(weight, bias, dtype, device)
    if device.type == "cuda" and (out_features % CUDA_MULTIPLE[method] or in_features % CUDA_MULTIPLE[method]):
        return None
    make = Int8Linear if method == "int8" else Fp8Linear
    return lambda weight, bias: make(weight, bias, dtype).to(device)


CUDA_MULTIPLE = {"int8": 8, "fp8": 16}
"""What the CUDA kernels want the in and out features of a layer to be multiples of."""


def quantize_model(model: nn.Module, method: str, dtype: torch.dtype) -> int:
    """Replaces the model's linear layers in place; returns how many were replaced."""
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings()
    total = sum(p.numel() for p in model.parameters())  # before: quantized weights become buffers
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                weight, bias = child.weight, child.bias
            elif isinstance(child, Conv1D):  # GPT-2's linears store (in, out)
                weight, bias = child.weight.T, child.bias
            else:
                continue
            make = quantizer(method, name, child, head, dtype, weight.device)
            if make is None:
                continue
            setattr(parent, name, make(weight, bias))
            count += 1
    # MoE experts kept as 3-D tensors (transformers 5's Mixtral, Qwen3-MoE) are no linear layers
    experts = sum(p.numel() for p in model.parameters() if p.ndim >= 3 and p.is_floating_point())
    if experts:
        log.warning("quantization %s: %d linear layers quantized; the MoE experts' weights (%.0f%% of the model's) "
                    "stay in %s, so the weights shrink less than a dense model's", method, count,
                    100 * experts / total, str(dtype).removeprefix("torch."))
    return count


def weights_nbytes(model: nn.Module) -> int:
    """Bytes the model's weights hold: parameters and buffers (int8 values and scales too),
    shared tensors once."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = (t.data_ptr(), t.numel())
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total
