"""Rotary scalings whose factors depend on a row's length, applied row by row in packed passes.

Phi-3's `longrope` uses its long factors once a sequence is longer than the model's original
context, else its short ones. transformers decides from the largest position in the forward
pass, which in a packed pass (or a padded batch) gives a short row the long factors. Here each
token gets the factors its own row would get at batch size 1: long when the row held more than
`original_max_position_embeddings` tokens when transformers computed it (a prompt token: the
whole prompt; a generated token at position p: p + 1), also when a row preempted past the
switch recomputes its positions in one prefill. The factors a prompt's keys were computed with
thus depend on the prompt's length, so the prefix cache names a long prompt's blocks apart
(`Scheduler.salt_of`).
"""
from __future__ import annotations

import torch


class RowwiseLongRope:
    """Wraps a model's longrope rotary module; `long_tokens` (T,) bool is set before each pass."""

    def __init__(self, rotary: torch.nn.Module, original: int):
        self.rotary = rotary
        self.original = original
        self.long_tokens: torch.Tensor | None = None
        raw = type(rotary).forward
        raw = getattr(raw, "__wrapped__", raw)  # the forward without transformers' per-pass switch
        short = rotary.original_inv_freq
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        long, _ = ROPE_INIT_FUNCTIONS["longrope"](rotary.config, short.device, seq_len=original + 1)

        def forward(x, position_ids):
            rotary.inv_freq = short
            cos, sin = raw(rotary, x, position_ids)
            if self.long_tokens is None:
                return cos, sin
            rotary.inv_freq = long
            cos_l, sin_l = raw(rotary, x, position_ids)
            rotary.inv_freq = short
            pick = self.long_tokens[None, :, None]  # (1, T, 1) over (1, T, dim)
            return torch.where(pick, cos_l, cos), torch.where(pick, sin_l, sin)

        rotary.forward = forward


def rowwise_longrope(model) -> RowwiseLongRope | None:
    """Installs row-wise longrope on `model` if it uses longrope; None otherwise."""
    text = model.config.get_text_config(decoder=True)
    params = getattr(text, "rope_parameters", None) or {}
    if not isinstance(params, dict) or params.get("rope_type") != "longrope":
        return None
    original = params.get("original_max_position_embeddings") or getattr(text, "original_max_position_embeddings")
    rotary = next((m for m in model.modules() if getattr(m, "rope_type", None) == "longrope"
                   and hasattr(m, "original_inv_freq")), None)
    if rotary is None:
        return None
    return RowwiseLongRope(rotary, int(original))
