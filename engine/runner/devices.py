"""Where an engine computes: its device, its dtype and its KV pool's dtype, from the config's
names (`auto` included). The pipeline's spec resolves `auto` the same way for an output's
record (pipeline.spec JobSpec.numerics)."""
from __future__ import annotations

import os

import torch

from engine.api.config import auto_dtype
from engine.api.errors import DeviceError


def resolve_device(name: str) -> torch.device:
    """`auto`: $BATCHINFER_DEVICE where set (e.g. cpu on a GPU machine), else CUDA where torch
    sees a device, else CPU."""
    if name == "auto":
        name = os.environ.get("BATCHINFER_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"device {name!r} asked for, but torch sees no CUDA device")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    return getattr(torch, auto_dtype(device.type) if name == "auto" else name)


def resolve_kv_dtype(name: str, device: torch.device) -> torch.dtype | None:
    """The KV pool's dtype: None = the model's; fp8 needs CUDA with compute capability >= 8.9."""
    if name == "auto":
        return None
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        where = device.type if device.type != "cuda" else f"{torch.cuda.get_device_name(device)} " \
            f"(compute capability {'.'.join(map(str, torch.cuda.get_device_capability(device)))})"
        raise ValueError(f"kv_cache_dtype fp8 needs a CUDA device of compute capability >= 8.9, not {where}")
    return torch.float8_e4m3fn
