"""The LoRA path of a forward pass: each adapted projection adds its rows' low-rank products to the
base layer's output, rows grouped by adapter slot, without ever merging an adapter into the weights.

The base layer runs once over every row of the pass whatever the mix of adapters (its weights are
read once). Then, per adapter slot present in the pass, its rows' inputs go through A (r, in) and
B (out, r) (the scaling folded into B) and are added to their outputs: a slice where the slot's
rows are contiguous in the pass, else gathered and scattered back (index_select / index_add_).
The grouping is computed once per pass (LoRAContext.begin) and shared by every layer."""
from __future__ import annotations

import re

import numpy as np
import torch
from torch import nn

DECODER_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj",
                       "gate_up_proj", "dense", "query_key_value", "dense_h_to_4h", "dense_4h_to_h", "fc1", "fc2",
                       "c_fc", "c_proj", "w1", "w2", "w3", "wqkv", "wo", "out_proj")
"""Leaf names of the decoder layers' linear projections an adapter may target (the 7 of Llama-like
families, fused and older families' names besides)."""
IN_LAYER = re.compile(r"(^|\.)(layers|h|blocks|layer)\.\d+\.")
"""A module inside a numbered decoder layer."""


class LoRAContext:
    """The current pass's tokens grouped by adapter slot: [(slot, slice or index tensor)], empty
    when no row of the pass has an adapter (then every LoRA layer is its base layer alone)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.groups: list[tuple[int, slice | torch.Tensor]] = []

    def begin(self, token_slots: np.ndarray | None) -> None:
        """token_slots: (T,) each token's adapter slot, -1 for the base model (None: all base)."""
        self.groups = []
        if token_slots is None:
            return
        for slot in np.unique(token_slots).tolist():
            if slot < 0:
                continue
            where = np.flatnonzero(token_slots == slot)
            lo, hi = int(where[0]), int(where[-1]) + 1
            if hi - lo == len(where):
                self.groups.append((slot, slice(lo, hi)))
            else:
                self.groups.append((slot, torch.from_numpy(where).to(self.device)))

    def end(self) -> None:
        self.groups = []


class LoRALinear(nn.Module):
    """A linear projection (plain or quantized) with up to `slots` adapters beside it."""

    def __init__(self, base: nn.Module, context: LoRAContext, slots: int):
        super().__init__()
        self.base = base
        self.context = context
        self.in_features, self.out_features = in_out(base)
        self.a: list[torch.Tensor | None] = [None] * slots
        self.b: list[torch.Tensor | None] = [None] * slots

    @property
    def weight(self):  # code that inspects the projection (dtype, device, shapes) sees the base's
        return self.base.weight

    def set_slot(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        self.a[slot], self.b[slot] = a, b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        groups = self.context.groups
        if not groups:
            return y
        x2 = x.reshape(-1, x.shape[-1])
        y2 = y.view(-1, y.shape[-1])
        for slot, rows in groups:
            a = self.a[slot]
            if a is None:  # this slot's adapter leaves this projection alone
                continue
            b = self.b[slot]
            if isinstance(rows, slice):
                y2[rows].addmm_(x2[rows] @ a.T, b.T)
            else:
                y2.index_add_(0, rows, (x2.index_select(0, rows) @ a.T) @ b.T)
        return y


def check_layer(base: nn.Module, device: torch.device, dtype: torch.dtype, paths) -> None:
    """A LoRALinear around `base` (one of the model's projections) with two rank-4 adapters, over a
    pass of six tokens whose slot-0 tokens are contiguous (the addmm_ path) and slot-1 tokens are
    not (index_add_), against base(x) + (x A^T) B^T per token: a FastPathError when they differ
    (LoRA has no second path). `paths`: the engine's engine.runner.fast_paths.FastPaths."""
    gen = torch.Generator().manual_seed(0)
    fan_in, fan_out = in_out(base)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.1).to(device=device, dtype=dtype)

    a, b = [rand(4, fan_in), rand(4, fan_in)], [rand(fan_out, 4), rand(fan_out, 4)]
    context = LoRAContext(device)
    layer = LoRALinear(base, context, 2)
    for slot in (0, 1):
        layer.set_slot(slot, a[slot], b[slot])
    x = rand(6, fan_in) * 10
    slots = np.array([0, 0, -1, 1, -1, 1])

    def fast():
        context.begin(slots)
        try:
            return layer(x).clone()
        finally:
            context.end()

    def reference():
        y = base(x).float()
        for t, slot in enumerate(slots.tolist()):
            if slot >= 0:
                y[t] += (x[t].float() @ a[slot].float().T) @ b[slot].float().T
        return y

    with torch.inference_mode():
        paths.check("lora", fast, reference, 2e-4 if dtype == torch.float32 else 3e-2,
                    "adapters cannot be served on this device: run without enable_lora", fatal=True)


def in_out(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of a linear layer (nn.Linear or the engine's quantized ones)."""
    return int(module.in_features), int(module.out_features)


def adaptable(model: nn.Module) -> dict[str, nn.Module]:
    """Module name -> projection, for every linear projection inside the decoder layers that an
    adapter may target (already wrapped ones give their base)."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            out[name] = module.base
            continue
        leaf = name.rsplit(".", 1)[-1]
        if (leaf in DECODER_PROJECTIONS and IN_LAYER.search(name) and hasattr(module, "in_features")
                and hasattr(module, "out_features") and not any(True for _ in module.children())):
            out[name] = module
    return out


def wrap(model: nn.Module, name: str, context: LoRAContext, slots: int) -> LoRALinear:
    """Replaces the projection `name` by a LoRALinear around it (once); returns it."""
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    current = getattr(parent, leaf)
    if isinstance(current, LoRALinear):
        return current
    layer = LoRALinear(current, context, slots)
    setattr(parent, leaf, layer)
    return layer
