"""The only place that runs the model: loads it, and runs one forward pass over a batch."""
from __future__ import annotations

import inspect
import logging

import torch

from engine.config import EngineConfig
from engine.kv_cache import KVCache
from engine.loader import load_model, load_tokenizer, resolve_model_dir

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {name!r} asked for, but torch sees no CUDA device")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # bf16 halves memory and doubles speed on GPUs; CPUs are exact and fastest in fp32.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def pack_lm_head(model, device: torch.device, dtype: torch.dtype) -> bool:
    """On CPU, runs the LM head (vocab x hidden: by far the largest matrix) through oneDNN with
    its weight prepacked once. With few rows per step, torch's default GEMM streams this matrix
    slowly: at 10 rows the head took 16 ms of a 41 ms decode step on builtin:llama-42m, packed
    7 ms (the step 41 -> 32 ms). Costs one extra copy of the head's weight. Returns whether it
    was packed."""
    from torch.utils import mkldnn

    head = model.get_output_embeddings()
    if (device.type != "cpu" or dtype != torch.float32 or type(head) is not torch.nn.Linear
            or not torch.backends.mkldnn.is_available()):
        return False
    model.set_output_embeddings(mkldnn.MkldnnLinear(head, dtype))
    return True


class ModelRunner:
    """Holds the model and tokenizer and runs forward passes over the KV pool.

    Masks are built here, on the device, as 4-D additive biases from each row's length, so
    transformers' mask code (which checks values on the host) never runs, and a decode pass has
    no device->host sync. On CUDA, decode passes replay CUDA graphs (`CudaGraphs`)."""

    def __init__(self, config: EngineConfig):
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model_dir = resolve_model_dir(config)
        self.hf_tokenizer = load_tokenizer(config, self.model_dir)
        self.model = load_model(config, self.model_dir, self.dtype, self.device)
        text_config = self.model.config.get_text_config(decoder=True)
        self.num_layers: int = text_config.num_hidden_layers
        self.vocab_size: int = self.model.get_output_embeddings().weight.shape[0]
        self.max_position_embeddings: int | None = (
            getattr(text_config, "max_position_embeddings", None) or getattr(text_config, "n_positions", None))
        self.sliding_window: int | None = getattr(text_config, "sliding_window", None)
        layer_types = set(getattr(text_config, "layer_types", None) or ())
        if layer_types and "sliding_attention" not in layer_types:
            self.sliding_window = None  # a window in the config that no layer uses
        self._mixed_layers = {"full_attention", "sliding_attention"} <= layer_types and bool(self.sliding_window)
        pack_lm_head(self.model, self.device, self.dtype)
        params = inspect.signature(self.model.forward).parameters
        # transformers 5 renamed past_key_values to cache; accept either.
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._takes_position_ids = "position_ids" in params
        self._takes_logits_to_keep = "logits_to_keep" in params
        self.graphs = None
        if self.device.type == "cuda" and not config.enforce_eager:
            from engine.cuda_graph import CudaGraphs
            self.graphs = CudaGraphs(self, config.max_num_seqs)

    def eos_token_ids(self) -> set[int]:
        """EOS ids from the generation config (as transformers' generate uses them)."""
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.model.config, "eos_token_id", None)
        if eos is None:
            return set()
        return set(eos) if isinstance(eos, (list, tuple)) else {eos}

    # -- masks --------------------------------------------------------------------------------

    def attention_bias(self, key_mask: torch.Tensor, query_cols: torch.Tensor):
        """key_mask (B, L) bool: columns a row may attend to at all; query_cols (B, S): the
        column each query token sits in (it sees columns <= its own). -> (B, 1, S, L) additive
        bias in the model's dtype (a dict per layer type for models that mix sliding-window
        and full-attention layers)."""
        cols = torch.arange(key_mask.shape[1], device=key_mask.device)
        allowed = key_mask[:, None, :] & (cols[None, None, :] <= query_cols[:, :, None])  # (B, S, L)
        full = self._bias(allowed)
        if not self.sliding_window:
            return full
        windowed = self._bias(allowed & (cols[None, None, :] > query_cols[:, :, None] - self.sliding_window))
        return {"full_attention": full, "sliding_attention": windowed} if self._mixed_layers else windowed

    def _bias(self, allowed: torch.Tensor) -> torch.Tensor:
        zero = torch.zeros((), dtype=self.dtype, device=allowed.device)
        return torch.where(allowed, zero, torch.finfo(self.dtype).min)[:, None]

    def decode_bias(self, lengths: torch.Tensor, width: int):
        """Decode: row i's new token sits at column lengths[i] and sees columns [0, lengths[i]]."""
        cols = torch.arange(width, device=lengths.device)
        return self.attention_bias(cols[None, :] <= lengths[:, None], lengths[:, None])

    # -- forward passes -----------------------------------------------------------------------

    def _kwargs(self, attention_mask, position_ids: torch.Tensor, cache: KVCache) -> dict:
        kwargs = {self._cache_kwarg: cache, "use_cache": True, "attention_mask": attention_mask}
        if self._takes_position_ids:
            kwargs["position_ids"] = position_ids
        return kwargs

    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor, attention_mask, position_ids: torch.Tensor,
               cache: KVCache) -> torch.Tensor:
        """Like `forward`, but the logits of every position: (B, S, V) in the model's dtype."""
        return self.model(input_ids=input_ids, **self._kwargs(attention_mask, position_ids, cache)).logits

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attention_mask, position_ids: torch.Tensor,
                cache: KVCache, last: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, position_ids (B, S); attention_mask: a bias from `attention_bias` -> logits
        (B, V) float32 at column `last` (B, 1) of each row (default: the final column)."""
        kwargs = self._kwargs(attention_mask, position_ids, cache)
        if self._takes_logits_to_keep:
            # Only the sampled positions go through the LM head.
            kwargs["logits_to_keep"] = 1 if last is None else last
        logits = self.model(input_ids=input_ids, **kwargs).logits
        if last is None or self._takes_logits_to_keep:
            return logits[:, -1, :].float()
        return logits.gather(1, last[:, :, None].expand(-1, 1, logits.shape[-1]))[:, 0, :].float()

    def prefill(self, cache: KVCache, start: int, input_ids: torch.Tensor, lengths: torch.Tensor,
                offset: int = 0) -> torch.Tensor:
        """Prompts into slots [start, start + k): input_ids (k, P) are their tokens from `offset`
        on (columns before it already hold keys and values), right-padded; lengths (k,) are the
        whole prompts' lengths. -> logits (k, V) at each prompt's last token."""
        k, p = input_ids.shape
        cols = offset + torch.arange(p, device=self.device)[None, :].expand(k, -1)
        cache.prefill(start, offset)
        keys = torch.arange(offset + p, device=self.device)[None, :] < lengths[:, None]
        return self.forward(input_ids, self.attention_bias(keys, cols), cols, cache, (lengths - 1 - offset)[:, None])

    def decode(self, cache: KVCache, tokens: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
        """One token per row of slots [0, n): tokens (n,) at columns lengths (n,); attention over
        columns [0, width). -> logits (n, V)."""
        if self.graphs is not None:
            logits = self.graphs.decode(cache, tokens, lengths)
            if logits is not None:
                return logits
        cache.decode(lengths, width)
        return self.forward(tokens[:, None], self.decode_bias(lengths, width), lengths[:, None], cache)
