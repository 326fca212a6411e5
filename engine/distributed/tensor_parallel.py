"""Loading one rank's shard of a model for tensor parallelism, and the all-reduce after its
row-parallel layers.

Which linear layers split, and how, comes from the architecture's transformers `tp_plan`
(`base_model_tp_plan`): `colwise` layers (Q, K, V by heads; gate and up) keep 1/N of their
output rows, `rowwise` layers (o_proj, down_proj) 1/N of their input columns, and the partial
sums of a decoder layer's attention and MLP are all-reduced. Phi-3's fused `qkv_proj` and
`gate_up_proj` (planned `colwise_gather_output` in transformers, which gathers them whole) are
split inside each of their sections instead, so every rank holds 1/N of them too.

A model with fewer KV heads than ranks (N a multiple of them) replicates them, as vLLM does: each
rank keeps the one KV head its query heads use (rank r: head r * kv // N).

A rank builds the model from a config whose head counts and intermediate size are divided by
N (the modeling code then allocates shards of the right shape), and reads only its slices
from the safetensors files (`safe_open(...).get_slice`). A quantized model's ranks read their
slices through ShardedFiles instead, tensor by tensor as the streaming loader asks for them
(engine.quantization.streaming): packed values, scales and zero points are cut along the axes
and packing their format's `layout` names, on group boundaries. The embedding is replicated (a
lookup of one row per token); the LM head is kept whole on rank 0 alone, which samples: no
gather of logits, and the other ranks skip its matmul.
"""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import torch
from torch import nn

from engine.api.errors import ModelLoadError

STYLES = {"colwise": "column", "rowwise": "row", "replicated_with_grad_allreduce": "replicated"}
"""tp_plan styles the engine shards as planned."""
FUSED = {"qkv_proj": "qkv", "gate_up_proj": "gate_up"}
"""Fused projections split inside each of their sections (whatever their planned style)."""
FUSED_ROW = {"o_proj", "down_proj"}
"""Row-parallel layers that follow a fused projection (planned rowwise_split_input)."""
KV = {"k_proj", "v_proj"}
"""Column-parallel layers split by KV heads (replicated where the ranks outnumber them)."""


def linear_styles(hf_config, n: int) -> dict[str, str]:
    """{module name pattern: column | row | replicated | qkv | gate_up} from the tp_plan; a
    one-line ModelLoadError for an architecture it cannot shard."""
    text = hf_config.get_text_config(decoder=True)
    archs = ", ".join(getattr(hf_config, "architectures", None) or [getattr(text, "model_type", "?")])
    tp_plan = getattr(text, "base_model_tp_plan", None)  # transformers' name for it
    if text is not hf_config or not tp_plan:
        raise ModelLoadError(f"tensor_parallel_size {n}: {archs} is not supported (it has no tensor-parallel plan "
                             "for its decoder)")
    styles = {}
    for pattern, style in tp_plan.items():
        leaf = pattern.rsplit(".", 1)[-1]
        kind = FUSED.get(leaf) or STYLES.get(style)
        if kind is None and style == "rowwise_split_input" and leaf in FUSED_ROW:
            kind = "row"
        if kind == "column" and leaf in KV:
            kind = "kv"
        if kind is None:
            raise ModelLoadError(f"tensor_parallel_size {n}: {archs} is not supported (its {leaf} is planned "
                                 f"{style!r}, which the engine does not shard)")
        styles[pattern] = kind
    return styles


def check_divisible(hf_config, n: int) -> None:
    """A one-line ModelLoadError naming every size that tensor_parallel_size does not divide."""
    text = hf_config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    sizes = {"num_attention_heads": heads, "intermediate_size": text.intermediate_size}
    bad = [f"{name} {value}" for name, value in sizes.items() if value % n]
    if kv % n and (n % kv or heads % n):
        bad.insert(1, f"num_key_value_heads {kv}" + (f" (nor is it a multiple of them: the {kv} KV heads are "
                                                      "replicated only then)" if kv < n else ""))
    if bad:
        raise ModelLoadError(f"tensor_parallel_size {n} does not divide the model's {', '.join(bad)}")


def check_shardable(hf_config, n: int) -> dict[str, str]:
    """Everything refused before any rank starts: the architecture and its sizes."""
    styles = linear_styles(hf_config, n)
    check_divisible(hf_config, n)
    return styles


def kv_parts(hf_config, n: int) -> int:
    """In how many parts the KV heads split: n, or each one (replicated) where they are fewer."""
    heads = hf_config.num_attention_heads
    return min(n, getattr(hf_config, "num_key_value_heads", None) or heads)


def rank_config(hf_config, n: int):
    """The config of one rank's shard: heads and intermediate size divided by n (KV heads at
    least one: replicated), head_dim explicit."""
    cfg = copy.deepcopy(hf_config)
    heads = cfg.num_attention_heads
    cfg.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    cfg.num_key_value_heads = max((getattr(cfg, "num_key_value_heads", None) or heads) // n, 1)
    cfg.num_attention_heads = heads // n
    cfg.intermediate_size //= n
    return cfg


class NoHead(nn.Module):
    """The LM head of a rank other than 0: no weight, zero logits per token (rank 0 samples)."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.out_features = vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., :0]


def load_shard(model_dir: Path, hf_config, attn_implementation: str, dtype: torch.dtype, device: torch.device,
               rank: int, n: int, trust_remote_code: bool = False):
    """Rank `rank`'s shard of the model (of n) in eval mode on `device`."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.initialization import no_init_weights

    styles = check_shardable(hf_config, n)
    with torch.device(device), no_init_weights():
        model = AutoModelForCausalLM.from_config(rank_config(hf_config, n), dtype=dtype,
                                                 attn_implementation=attn_implementation,
                                                 trust_remote_code=trust_remote_code)
    if rank:
        model.set_output_embeddings(NoHead(hf_config.vocab_size))
    _read_weights(model, model_dir, hf_config, styles, rank, n)
    if not rank and getattr(hf_config, "tie_word_embeddings", False):
        # the checkpoint holds the head once, as the input embedding (replicated on every rank);
        # a model built under no_init_weights is not tied, so rank 0's head would stay unset
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
        if head.weight.shape != embedding.weight.shape:
            raise ModelLoadError(f"tensor_parallel_size {n}: the tied head {tuple(head.weight.shape)} and input "
                                 f"embedding {tuple(embedding.weight.shape)} differ in shape")
        head.weight = embedding.weight
    if (model_dir / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    return model.eval()


def _read_weights(model, model_dir: Path, hf_config, styles: dict[str, str], rank: int, n: int) -> None:
    from safetensors import safe_open

    where = _weight_map(model_dir)
    handles = {}
    sections = fused_sections(hf_config, n)
    tied = getattr(hf_config, "tie_word_embeddings", False)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name not in where:
                if tied and name == "lm_head.weight":
                    continue
                raise ModelLoadError(f"{model_dir}: no tensor {name} in the safetensors files")
            file = where[name]
            if file not in handles:
                handles[file] = safe_open(str(model_dir / file), framework="pt", device="cpu")
            kind = style_of(name.rsplit(".", 1)[0], styles)
            part = _slice(handles[file].get_slice(name), kind, name.endswith(".bias"), sections, rank, n)
            if part.shape != param.shape:
                raise ModelLoadError(f"tensor_parallel_size {n}: {name} shards to {tuple(part.shape)} but the "
                                     f"rank's model holds {tuple(param.shape)}")
            param.copy_(part.to(param.dtype))


def style_of(module: str, styles: dict[str, str]) -> str:
    """How the linear layer named `module` is sharded (a kind of linear_styles; else replicated)."""
    for pattern, kind in styles.items():
        if re.search(r"(^|\.)" + re.escape(pattern).replace(r"\*", r"\d+") + "$", module):
            return kind
    return "replicated"


def shard_tensor(tensor: torch.Tensor, kind: str, sections: dict, rank: int, n: int) -> torch.Tensor:
    """This rank's part of a whole weight-shaped tensor (out, in) sharded as `kind` (a LoRA factor:
    row kinds keep columns, column kinds rows, fused ones section by section)."""
    return _slice(_View(tensor), kind, False, sections, rank, n)


def whole_rows(kind: str, rows: int, sections: dict, n: int) -> int:
    """The output rows of the whole projection whose shard of kind `kind` holds `rows`."""
    if kind in sections:
        return sum(size for size, _ in sections[kind])
    return rows * n if kind == "column" else rows


PLAIN = {"weight": (0, 1, 1, 1), "bias": (0, 1, None, 1)}
"""A plain linear layer's tensors: (output axis, outputs per stored element, input axis, inputs
per stored element); None where the tensor has no such axis."""


class ShardedFiles:
    """A checkpoint's tensors (engine.quantization.streaming.SafetensorsFiles) as one rank holds
    them: each cut to this rank's slice as it is read, only the slice's rows read (a replicated
    one whole). `layout` (suffix) -> the axes of a quantized format's tensors (a format's
    `layout`; PLAIN otherwise)."""

    def __init__(self, files, styles: dict[str, str], sections: dict, rank: int, n: int, layout=None):
        self.files, self.styles, self.sections, self.rank, self.n = files, styles, sections, rank, n
        self.layout = layout or PLAIN.get

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def dtype(self, name: str) -> torch.dtype:
        return self.files.dtype(name)

    def get(self, name: str) -> torch.Tensor:
        module, _, suffix = name.rpartition(".")
        kind = style_of(module, self.styles)
        if kind == "replicated" or not self.files.shape(name):
            return self.files.get(name)
        axes = self.layout(suffix) or PLAIN.get(suffix) or (0, 1, None, 1)
        try:
            return _slice(self.files.slice(name), kind, suffix == "bias", self.sections, self.rank, self.n,
                          axes).contiguous()
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None


class _View:
    """A tensor seen as a safetensors slice (what _slice reads)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index):
        return self.tensor[index]


def _weight_map(model_dir: Path) -> dict[str, str]:
    """Tensor name -> safetensors file name."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    from safetensors import safe_open

    where = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            where.update(dict.fromkeys(f.keys(), path.name))
    if not where:
        raise ModelLoadError(f"tensor parallelism reads safetensors weights: none in {model_dir}")
    return where


def fused_sections(hf_config, n: int) -> dict[str, list[tuple[int, int]]]:
    """(output rows, parts among the n ranks) of each section of the fused projections and of the
    KV projections: n parts, but one per KV head where they are fewer (replicated)."""
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    hd = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    inter = hf_config.intermediate_size
    kv_section = (kv * hd, kv_parts(hf_config, n))
    return {"qkv": [(heads * hd, n), kv_section, kv_section], "gate_up": [(inter, n), (inter, n)], "kv": [kv_section]}


def _slice(view, kind: str, bias: bool, sections: dict, rank: int, n: int,
           axes: tuple = (0, 1, 1, 1)) -> torch.Tensor:
    """This rank's part of one checkpoint tensor (read from the file: only the slice). `axes`:
    (output axis, outputs per stored element, input axis, inputs per stored element), as PLAIN
    names them; an axis of one element (a per-tensor or per-channel scale) is kept whole. A
    ValueError where the cut falls inside a packed element or a group."""
    shape = view.get_shape()
    out_axis, out_per, in_axis, in_per = axes
    if kind == "replicated":
        return view[:]
    if kind == "row":
        if bias:  # added once, after the all-reduce sums the ranks' partial products
            return view[:] if rank == 0 else torch.zeros_like(view[:])
        if in_axis is None or shape[in_axis] == 1:
            return view[:]
        stored = shape[in_axis]
        if stored % n:
            raise ValueError(f"tensor_parallel_size {n} splits its {stored * in_per} inputs inside a group of "
                             f"{in_per} (each rank would hold {stored * in_per / n:g})")
        return view[_along(len(shape), in_axis, rank * (stored // n), (rank + 1) * (stored // n))]
    if out_axis is None or shape[out_axis] == 1:
        return view[:]
    parts, offset = [], 0
    for size, pieces in sections.get(kind, [(shape[out_axis] * out_per, n)]):
        step = size // pieces
        if step % out_per:
            raise ValueError(f"tensor_parallel_size {n} splits its {size} outputs inside a group of {out_per} "
                             f"(each rank would hold {step})")
        start = offset + rank * pieces // n * step // out_per
        parts.append(view[_along(len(shape), out_axis, start, start + step // out_per)])
        offset += size // out_per
    return torch.cat(parts, dim=out_axis) if len(parts) > 1 else parts[0]


def _along(dims: int, axis: int, start: int, stop: int) -> tuple:
    """The index of elements start..stop along `axis` of a tensor of `dims` dimensions."""
    return tuple(slice(start, stop) if d == axis else slice(None) for d in range(dims))


def add_all_reduce(model) -> None:
    """Sums each decoder layer's attention and MLP outputs over the ranks (their row-parallel
    output projections leave partial sums)."""
    for layer in model.get_decoder().layers:
        for part in (layer.self_attn, layer.mlp):
            part.register_forward_hook(_all_reduce_output)


def _all_reduce_output(module, args, output):
    import torch.distributed as dist

    dist.all_reduce(output[0] if isinstance(output, tuple) else output)
    return output
