"""Every fast path an engine takes is checked once, on a tiny input, against the torch reference
beside it, before the engine trusts it; one that raises or disagrees is turned off for that engine.

The paths (each named as the manifest's engines and `batchinfer report` name it):

- `cpu_attention`: the C++ paged-attention kernel (engine.runner.attention), checked when it first
  serves this engine (it is built in the background, so that may be well into a job);
- `triton_decode` and `triton_prefill`: the Triton kernels on CUDA, at the model's head size, KV
  heads, block size, KV dtype, sliding window and soft cap, at their first use;
- `cuda_graphs`: one replay of the first captured decode graph against the same pass run eagerly
  (engine.runner.cuda_graph); a capture that raises falls back the same way;
- `int8_gemm`, `int4_gemm`, `fp8_gemm`: the first quantized layer of each kind against the product
  with its `dequantized()` weight (int4's `dequantized()` runs the kernel itself on the identity,
  so its check catches a kernel that raises or answers differently for other inputs, not a wrong
  packing).

A path that fails is turned off for this engine only (another engine in the process decides for
itself) and its reference runs instead: one warning names the path, the error or the largest
difference, and the fallback. With `strict_kernels` the failure is a FastPathError instead.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Callable

import torch

from engine.api.errors import FastPathError, one_line

log = logging.getLogger(__name__)

CHECKED = "checked"
FELL_BACK = "fell back"


class FastPaths:
    """One engine's record of its fast paths: which were checked, which fell back and why."""

    def __init__(self, strict: bool = False):
        self.strict = strict
        """strict_kernels: a failed check raises FastPathError instead of falling back."""
        self.state: dict[str, str] = {}
        """path -> "checked", or "fell back: <why>; <the reference> instead"."""
        self.check_seconds: dict[str, float] = {}
        """path -> host seconds its check took (a kernel's first compilation included)."""

    def usable(self, path: str) -> bool | None:
        """True: checked and on; False: fell back; None: not checked yet."""
        state = self.state.get(path)
        return None if state is None else state == CHECKED

    def check(self, path: str, fast: Callable[[], torch.Tensor], reference: Callable[[], torch.Tensor],
              tolerance: float, fallback: str, fatal: bool = False) -> bool:
        """Runs `fast` and `reference` once (unless `path` was checked already) and keeps the path
        on when they agree within `tolerance` (largest difference over the reference's largest
        magnitude). Returns whether the path is on. `fatal`: a path with no second one, whose
        failure is a FastPathError whatever strict_kernels says (`fallback` then says what to do)."""
        known = self.usable(path)
        if known is not None:
            return known
        started = time.perf_counter()
        try:
            got, want = fast(), reference()
            diff = relative_difference(got, want)
            why = None if diff <= tolerance else (
                f"differs from the reference by {diff:.3g} of its largest value (tolerance {tolerance:g})")
        except Exception as exc:  # noqa: BLE001  any failure of the fast path: the reference runs instead
            why = one_line(exc)
        self.check_seconds[path] = time.perf_counter() - started
        if why is not None and fatal:
            raise FastPathError(f"{path} failed its check ({why}); {fallback}")
        if why is not None:
            self.fall_back(path, why, fallback)
            return False
        self.state[path] = CHECKED
        return True

    def fall_back(self, path: str, why: str, fallback: str) -> None:
        """Turns `path` off for this engine with one warning (a FastPathError under strict_kernels)."""
        if self.strict:
            raise FastPathError(f"{path} failed its check ({why}); engine.strict_kernels is set, so the engine "
                                f"stops instead of running {fallback}")
        if self.state.get(path, "").startswith(FELL_BACK):
            return
        log.warning("%s failed its check (%s); this engine runs %s instead", path, why, fallback)
        self.state[path] = f"{FELL_BACK}: {why}; {fallback} instead"

    def facts(self) -> dict[str, str]:
        """What the manifest's engines record: each path this engine took, checked or fallen back."""
        return dict(sorted(self.state.items()))


def relative_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (inf for a shape mismatch or a value that is not finite)."""
    if tuple(got.shape) != tuple(want.shape):
        return math.inf
    got, want = got.detach().float(), want.detach().float()
    if not bool(torch.isfinite(got).all()):
        return math.inf
    if not want.numel():
        return 0.0
    return float((got - want).abs().max()) / max(float(want.abs().max()), 1e-6)


def attention_tolerance(dtype: torch.dtype) -> float:
    """How far a kernel's attention may be from the reference's, relative to its largest value."""
    return 2e-4 if dtype == torch.float32 else 3e-2


# -- quantized layers ---------------------------------------------------------------------------

QUANTIZED_TOLERANCE = {"int8": 0.06, "int4": 0.03, "fp8": 0.12}
"""Against the product with the dequantized weight: int8 and fp8 also quantize the activations
(per token: 7 or 8 bits, 3 mantissa bits); int4 runs its activations in bfloat16."""


def check_quantized(model: torch.nn.Module, method: str, dtype: torch.dtype, paths: FastPaths) -> None:
    """Checks the first quantized layer of `model` against its dequantized weight's product (on
    three rows in the model's dtype); when it fails, every quantized layer runs that product
    instead (memory unchanged, slower)."""
    from engine.quantization.int4 import Int4Linear
    from engine.quantization.methods import Fp8Linear, Int8Linear

    kind = {"int8": Int8Linear, "int4": Int4Linear, "fp8": Fp8Linear}.get(method)
    layers = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
              if kind is not None and isinstance(child, kind)]
    if not layers:
        return
    layer = layers[0][2]
    device = next(layer.buffers()).device
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype)
    path = f"{method}_gemm"
    int4 = method == "int4"  # its dequantized() runs the same kernel: no second path to fall back on
    with torch.inference_mode():
        ok = paths.check(path, lambda: layer(x), lambda: DequantizedLinear(layer)(x), QUANTIZED_TOLERANCE[method],
                         "int4 has no reference path: run without quantization or with int8" if int4 else
                         "the product with each layer's dequantized weight", fatal=int4)
    if ok:
        return
    for parent, name, child in layers:
        setattr(parent, name, DequantizedLinear(child))


class DequantizedLinear(torch.nn.Module):
    """A quantized layer run as x @ dequantized()^T + bias (the reference its kernel is held to)."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.layer = layer
        self.out_features = layer.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.layer.bias
        y = torch.nn.functional.linear(x.float(), self.layer.dequantized().to(x.device),
                                       None if bias is None else bias.float())
        return y.to(x.dtype)
