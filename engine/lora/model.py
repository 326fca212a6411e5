"""A model's LoRA state: the adapters read on the host (least recently used kept, max_cpu_loras of
them) and the device slots their weights are installed in, layer by layer.

Under tensor parallelism each rank installs its share of an adapter the way its layers are
sharded: a column-parallel projection (Q, K, V, gate, up; fused ones section by section) keeps
its rows of B, a row-parallel one (o, down) its columns of A, so the rank's low-rank product is
its share of the layer's output, summed by the same all-reduce as the base layer's."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

import torch
from torch import nn

from engine.api.config import EngineConfig
from engine.api.errors import AdapterError
from engine.api.lora import LoRARequest
from engine.distributed.tensor_parallel import shard_tensor, style_of, whole_rows
from engine.lora.adapters import AdapterWeights, read_adapter
from engine.lora.layers import LoRAContext, LoRALinear, adaptable, check_layer, in_out, wrap


class LoRAModel:
    """LoRA on one rank's model. `shard`: (styles, sections, rank, n) under tensor parallelism."""

    def __init__(self, config: EngineConfig, model: nn.Module, device: torch.device, dtype: torch.dtype,
                 shard: tuple | None = None, paths=None):
        self.config = config
        self.model = model
        self.device = device
        self.dtype = dtype
        self.shard = shard
        self.context = LoRAContext(device)
        """The current pass's rows by slot, read by every LoRALinear."""
        self.targets = {name: self._full_shape(name, m) for name, m in adaptable(model).items()}
        """Module name -> (in, out) features of the whole (unsharded) projection."""
        self.host: OrderedDict[int, AdapterWeights] = OrderedDict()
        self.paths: dict[int, tuple[str, str]] = {}
        """lora_int_id -> (lora_name, lora_path) first seen: one id names one adapter."""
        self.layers: dict[str, LoRALinear] = {}
        if paths is not None and shard is None and self.targets:  # (a shard's projection all-reduces: not alone)
            check_layer(next(iter(adaptable(model).values())), device, dtype, paths)

    def _full_shape(self, name: str, module: nn.Module) -> tuple[int, int]:
        fan_in, fan_out = in_out(module)
        if self.shard is None:
            return fan_in, fan_out
        styles, sections, _, n = self.shard
        kind = style_of(name, styles)
        if kind == "row":
            return fan_in * n, fan_out
        return fan_in, whole_rows(kind, fan_out, sections, n)

    def read(self, request: LoRARequest) -> AdapterWeights:
        """The adapter's host weights (read and checked once; kept while among the max_cpu_loras most
        recently used). AdapterError names the adapter and the cause."""
        if not self.config.enable_lora:
            raise AdapterError(f"adapter {request.lora_name}: LoRA is not enabled (set enable_lora)")
        seen = self.paths.get(request.lora_int_id)
        if seen is not None and seen != (request.lora_name, request.lora_path):
            raise AdapterError(f"lora_int_id {request.lora_int_id} names adapter {seen[0]} ({seen[1]}); "
                               f"{request.lora_name} ({request.lora_path}) needs another id")
        weights = self.host.get(request.lora_int_id)
        if weights is not None:
            self.host.move_to_end(request.lora_int_id)
            return weights
        weights = read_adapter(request, self.config, self.targets)
        self.paths[request.lora_int_id] = (request.lora_name, request.lora_path)
        self.host[request.lora_int_id] = weights
        while len(self.host) > (self.config.max_cpu_loras or 2 * self.config.max_loras):
            self.host.popitem(last=False)
        return weights

    def local(self, request: LoRARequest) -> LoRARequest:
        """The request pointing at its local copy (what other ranks read, without fetching again)."""
        return replace(request, lora_path=str(self.read(request).path))

    @torch.inference_mode()
    def install(self, slot: int, request: LoRARequest) -> None:
        """Puts the adapter's weights (this rank's share) into device slot `slot` of every layer,
        clearing the slot in the layers it leaves alone."""
        weights = self.read(request)
        for name, layer in self.layers.items():
            if name not in weights.modules:
                layer.set_slot(slot, None, None)
        for name, (a, b) in weights.modules.items():
            layer = self.layers.get(name)
            if layer is None:
                layer = self.layers[name] = wrap(self.model, name, self.context, self.config.max_loras)
            if self.shard is not None:
                styles, sections, rank, n = self.shard
                kind = style_of(name, styles)
                if kind == "row":
                    a = shard_tensor(a, "row", sections, rank, n)
                elif kind != "replicated":
                    b = shard_tensor(b, kind, sections, rank, n)
            layer.set_slot(slot, a.to(self.device, self.dtype).contiguous(), b.to(self.device, self.dtype).contiguous())
