"""Token states to one vector per row, and what sentence-transformers does after pooling."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.pooling import DenseLayer, PoolingInfo

ACTIVATION_FNS = {"identity": lambda x: x, "tanh": torch.tanh, "relu": torch.relu, "gelu": F.gelu,
                  "sigmoid": torch.sigmoid}


def pool_rows(states: torch.Tensor, lengths: list[int], kind: str) -> torch.Tensor:
    """states (T, H): the rows' tokens back to back -> (R, H), float32."""
    states = states.float()
    if kind == "CLS":
        starts = torch.tensor([0] + lengths[:-1], device=states.device).cumsum(0)
        return states[starts]
    if kind == "LAST":
        ends = torch.tensor(lengths, device=states.device).cumsum(0) - 1
        return states[ends]
    parts = torch.split(states, lengths)
    if kind == "MEAN":
        return torch.stack([p.mean(0) for p in parts])
    if kind == "MAX":
        return torch.stack([p.max(0).values for p in parts])
    raise ValueError(f"unknown pooling type {kind!r}")


class PostPooling(torch.nn.Module):
    """A sentence-transformers model's Dense modules, in order (weights from their folders)."""

    def __init__(self, layers: list[DenseLayer], device: torch.device):
        super().__init__()
        from safetensors.torch import load_file

        self.layers = []
        for layer in layers:
            linear = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias)
            files = sorted(layer.path.glob("*.safetensors"))
            if not files:
                from engine.api.errors import ModelLoadError

                raise ModelLoadError(f"{layer.path}: a Dense module without safetensors weights")
            weights = load_file(str(files[0]))
            linear.load_state_dict({k.removeprefix("linear."): v for k, v in weights.items()})
            self.layers.append((linear.to(device=device, dtype=torch.float32).eval(), ACTIVATION_FNS[layer.activation]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for linear, act in self.layers:
            x = act(linear(x))
        return x


def finish_embeddings(pooled: torch.Tensor, post: PostPooling | None, dims: list[int | None],
                      normalize: list[bool]) -> list[list[float]]:
    """Dense modules, the Matryoshka cut, then L2 normalisation, per row."""
    if post is not None and post.layers:
        pooled = post(pooled)
    out = []
    for vec, d, norm in zip(pooled, dims, normalize):
        if d is not None:
            vec = vec[:d]
        if norm:
            vec = F.normalize(vec, p=2, dim=0)
        out.append(vec.tolist())
    return out


def head_activation(logits: torch.Tensor, info: PoolingInfo) -> torch.Tensor:
    """(R, num_labels) -> probabilities: a one-label head's logit through the cross-encoder's
    activation (sigmoid by default, as sentence-transformers applies it), else a softmax."""
    if logits.shape[-1] == 1:
        return ACTIVATION_FNS[info.score_activation](logits)
    return torch.softmax(logits, dim=-1)
