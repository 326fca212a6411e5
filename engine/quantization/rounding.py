"""Rounding a weight a block of rows at a time, so that quantizing a layer never holds a float32
copy of the whole matrix."""
from __future__ import annotations

import torch

CHUNK_ELEMENTS = 1 << 18
"""Weights are rounded a block of rows at a time, about this many values: the float32 temporary
of quantizing stays 1 MiB whatever the layer (the LM head of a 128k vocabulary is 0.5-1 GiB)."""


def row_chunks(w: torch.Tensor) -> list[slice]:
    """Row blocks of `w` (N, K) of about CHUNK_ELEMENTS values each."""
    step = max(1, CHUNK_ELEMENTS // max(1, w.shape[1]))
    return [slice(i, min(i + step, w.shape[0])) for i in range(0, w.shape[0], step)]
