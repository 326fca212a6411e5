"""Float32 linear layers on CPU through oneDNN: the LM head on its own (often tied) weight, and every
other plain linear layer on a weight oneDNN reordered once, at load, into its own blocked layout.

Why: torch's default CPU GEMM (MKL's sgemm) copies the weight into its packed layout at every call.
At decode's few rows a layer's time is mostly reading its weight, so that copy costs about as much
as the product. oneDNN's reordered weight (`torch.ops.mkldnn._reorder_linear_weight`, as
torch.compile's CPU freezing makes it) skips the copy. Measured on this 2-core AVX2 CPU, float32,
2 threads, SmolLM2-135M's shapes (576 -> 1536, 1536 -> 576, 576 -> 576, 576 -> 192) at 8-32 rows:
0.5-0.75x MKL's time per call, and 1.47-1.7x the engine's decode tokens/s over 32 chat prompts
(identical greedy tokens). Prefill sizes are no slower (2,048 rows: 52.8 ms against 55.9).

The reordered weight is an opaque oneDNN tensor: it has a shape and dtype but no storage a
caller can read, so it is a plain attribute, not a parameter. The runner counts the weights'
bytes before packing; code that needs the values reads them from the checkpoint, not the layer.
A layer that shares its weight with another (a tied head) is left alone: packing it would hold
a second copy."""
from __future__ import annotations

import ctypes
import mmap
import sys
import warnings

import torch

PACK_ROWS = 32
"""The rows oneDNN is told to expect when it picks the weight's layout (decode's batch; measured
no slower at 1 or 2,048 rows than a layout picked for those)."""
PACK_TOLERANCE = 1e-4
"""Largest difference, relative to the output's largest magnitude, a packed layer may show against
torch's linear on its check (float32 GEMMs differ in summation order only: ~1e-6 here)."""


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack_lm_head(model, device: torch.device, dtype: torch.dtype) -> bool:
    """On CPU, runs the LM head (vocab x hidden: by far the largest matrix) through oneDNN's
    linear, on the head's own weight (the input embedding's, when tied: no copy). Measured on
    this 2-core CPU at 32,000 x 512, float32, 2 threads, 1 / 8 / 64 / 256 rows: 1.2 / 2.6 / 7.3 /
    21 ms, against torch's default GEMM's 1.3 / 3.7 / 7.8 / 26 ms. The oneDNN module with a
    prepacked copy that ran it before (`torch.utils.mkldnn.MkldnnLinear`) took 1.3 / 3.3 / 11 /
    40 ms: it also converts each step's logits back from oneDNN's layout. A reordered copy of a
    49,152 x 576 head (SmolLM2's) saves ~6 ms of a 250 ms step at 20 rows, for 113 MB more:
    not worth holding. Returns whether the head runs through oneDNN."""
    head = model.get_output_embeddings()
    if not packs_head(head, device, dtype):
        return False
    model.set_output_embeddings(OneDnnLinear(head))
    return True


class OneDnnLinear(torch.nn.Module):
    """A float32 linear layer computed by oneDNN (`torch.ops.mkldnn._linear_pointwise`, as
    torch.compile's CPU backend calls it) on the same weight and bias tensors as `linear`."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.weight, self.bias,
                                                "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)


def packs_head(head, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether pack_lm_head runs this head through oneDNN: a plain linear one, float32 on CPU."""
    return type(head) is torch.nn.Linear and onednn_available(device, dtype)


class PackedLinear(OneDnnLinear):
    """A float32 linear layer on a weight oneDNN reordered once (an opaque tensor, see the module's
    docstring). `weight` still answers shape, dtype and device; `packed_nbytes` is what it holds."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__(linear)
        del self.weight  # the parameter `linear` registered: the reordered tensor is a plain attribute
        self.weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_ROWS)
        self.packed_nbytes = linear.weight.numel() * linear.weight.element_size()
        for hooks in HOOKS:  # the same dicts: a tensor-parallel all-reduce hook, and its handle, carry over
            setattr(self, hooks, getattr(linear, hooks))


HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
         "_forward_hooks_always_called")


def pack_linears(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Replaces every plain float32 nn.Linear of `model` whose weight no other module shares by a
    PackedLinear (its forward hooks carried over), on CPU where oneDNN is available; returns how
    many. Quantized and LoRA layers are other types and tied ones are shared: they stay. The first
    layer is checked against torch's linear on a small input first: if oneDNN raises or differs
    beyond PACK_TOLERANCE, nothing is packed and one warning says so (the layers then run torch's
    linear, as before)."""
    if not onednn_available(device, dtype):
        return 0
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is torch.nn.Linear and child.weight.dtype == torch.float32
               and owners.get(id(child.weight)) == 1]
    if not targets:
        return 0
    first, problem = _check(targets[0][2])
    if problem:
        warnings.warn(f"oneDNN's packed linear layers are off for this engine ({problem}): torch's linear runs them",
                      stacklevel=2)
        return 0
    mapped = FileMappings.read()
    for parent, name, child in targets:
        setattr(parent, name, first if child is targets[0][2] else PackedLinear(child))
        mapped.drop(child.weight)
    return len(targets)


class FileMappings:
    """The file mappings of this process that hold checkpoint weights (transformers loads a
    safetensors file's tensors as views of a private mmap of it). A weight read from one is
    resident once read: after its reordered copy is made, the whole pages that only it covers are
    given back (madvise MADV_DONTNEED: the file is unchanged, and a later read of those bytes, if
    any, reads the file again). Without this, packing left the float32 weights resident twice
    (SmolLM2: 852 MiB added at load, against 513 MiB of weights)."""

    def __init__(self, spans: list[tuple[int, int]]):
        self.spans = spans
        self._madvise = None

    @classmethod
    def read(cls) -> "FileMappings":
        spans = []
        if sys.platform.startswith("linux"):
            try:
                with open("/proc/self/maps") as maps:
                    for line in maps:
                        fields = line.split()
                        if len(fields) >= 6 and fields[5].endswith(".safetensors"):
                            lo, hi = (int(x, 16) for x in fields[0].split("-"))
                            spans.append((lo, hi))
            except OSError:
                pass
        return cls(spans)

    def drop(self, tensor: torch.Tensor) -> int:
        """Gives back the whole pages of `tensor` (a weight no longer used) inside a checkpoint
        mapping; returns the bytes. Pages it shares with a neighbouring tensor stay."""
        if not self.spans or tensor.device.type != "cpu":
            return 0
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()
        if not any(lo <= start and end <= hi for lo, hi in self.spans):
            return 0
        page = mmap.PAGESIZE
        lo, hi = -(-start // page) * page, end // page * page
        if hi <= lo:
            return 0
        if self._madvise is None:  # once per engine, not per layer
            self._madvise = ctypes.CDLL(None, use_errno=True).madvise
            self._madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        return hi - lo if self._madvise(lo, hi - lo, 4) == 0 else 0  # 4: MADV_DONTNEED


def _check(linear: torch.nn.Linear) -> tuple[PackedLinear | None, str]:
    """(the packed copy of `linear`, '') when it gives torch's output on 3 random rows, else
    (None, why not)."""
    x = torch.randn(3, linear.in_features, generator=torch.Generator().manual_seed(0))
    try:
        with torch.inference_mode():
            want = torch.nn.functional.linear(x, linear.weight, linear.bias)
            packed = PackedLinear(linear)
            got = packed.forward(x)  # not __call__: its forward hooks (an all-reduce) stay out
    except Exception as exc:  # noqa: BLE001 - any failure of the fast path means using the plain one
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    diff = float((got - want).abs().max())
    if not diff <= PACK_TOLERANCE * max(1.0, float(want.abs().max())):
        return None, f"largest difference {diff:.2e} on a check"
    return packed, ""
