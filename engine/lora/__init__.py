"""LoRA adapters: PEFT directories read and checked against the base model, the layers adding each
row's low-rank products beside the base projections, adapters in device slots, requests routed."""
from engine.lora.adapters import AdapterWeights, file_digest, read_adapter, resolve_adapter_dir
from engine.lora.layers import LoRAContext, LoRALinear, adaptable, in_out
from engine.lora.model import LoRAModel
from engine.lora.router import AdapterRouter

__all__ = ["AdapterWeights", "read_adapter", "resolve_adapter_dir", "file_digest", "LoRAContext", "LoRALinear",
           "adaptable", "in_out", "LoRAModel", "AdapterRouter"]
