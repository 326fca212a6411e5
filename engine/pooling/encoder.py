"""Bidirectional encoders (BERT, RoBERTa / XLM-R, ModernBERT), packed without padding.

A pass packs its rows back to back into one sequence (batch size 1, T tokens) with each token's
own position; the attention function registered with transformers runs SDPA over each row's
own tokens (rows of one length in one call), so no padding is computed and no mask is built.
Heads (pooler + classifier) run on the pooled rows afterwards."""
from __future__ import annotations

import inspect
import warnings

import torch
import torch.nn.functional as F

from engine.api.config import EngineConfig
from engine.api.errors import AttentionOutsideEngine, ModelLoadError, one_line
from engine.models.builtin import quiet_transformers
from engine.models.files import check_weights, load_tokenizer
from engine.models.pooling import PoolingInfo
from engine.runner.devices import resolve_device, resolve_dtype
from engine.runner.loader import check_loaded
from engine.runner.onednn import pack_linears

IMPLEMENTATION = "batchinfer_varlen"
ROBERTA_TYPES = ("roberta", "xlm-roberta", "camembert")


def varlen_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                             sliding_window=None, **kwargs):
    """query/key/value (1, H, T, D) of packed rows -> ((1, T, H, D), None)."""
    rows = kwargs.get("batchinfer_rows")
    if rows is None:
        raise AttentionOutsideEngine(f"{IMPLEMENTATION} attention runs only inside batchinfer's engine")
    out = torch.empty_like(query)
    window = int(sliding_window or 0)
    start = 0
    for length, count in rows:
        end = start + length * count
        shape = (query.shape[1], count, length, query.shape[-1])
        q, k, v = (t[0, :, start:end].reshape(shape).transpose(0, 1) for t in (query, key, value))
        mask = None
        if window and length > window:
            idx = torch.arange(length, device=query.device)
            mask = (idx[:, None] - idx[None, :]).abs() < window
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
        out[0, :, start:end] = o.transpose(0, 1).reshape(query.shape[1], end - start, query.shape[-1])
        start = end
    return out.transpose(1, 2), None


def register() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, varlen_attention_forward)
    return IMPLEMENTATION


class EncoderRunner:
    """Holds an encoder (with its classification head, if any) and runs packed passes."""

    def __init__(self, config: EngineConfig, model_dir, info: PoolingInfo):
        from transformers import AutoModel, AutoModelForSequenceClassification

        self.info = info
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.hf_tokenizer = load_tokenizer(config, model_dir)
        check_weights(model_dir, config.allow_pickle)
        quiet_transformers()
        cls = AutoModelForSequenceClassification if info.classifier else AutoModel
        kwargs = {**config.extra, "attn_implementation": register()}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model, loading = cls.from_pretrained(model_dir, dtype=self.dtype,
                                                     trust_remote_code=config.trust_remote_code,
                                                     use_safetensors=None if config.allow_pickle else True,
                                                     output_loading_info=True, **kwargs)
        except Exception as exc:
            raise ModelLoadError(f"cannot load {info.name} from {model_dir}: {one_line(exc)}") from exc
        if not info.classifier:  # an embedding model's body alone runs: BERT's pooler layer is never used
            loading = {**loading, "missing_keys": [k for k in loading.get("missing_keys") or ()
                                                   if not k.startswith("pooler.")]}
        check_loaded(model_dir, loading)  # a classifier's head the checkpoint lacks would be random
        self.model = model.to(self.device).eval()
        self.body = self.model.base_model
        params = inspect.signature(self.body.forward).parameters
        self._token_types = "token_type_ids" in params and getattr(self.model.config, "type_vocab_size", 0) > 1
        self._position_offset = (self.model.config.pad_token_id + 1) if info.model_type in ROBERTA_TYPES else 0
        self.vocab_size = self.model.config.vocab_size
        self.weights_nbytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.packed_linears = pack_linears(self.model, self.device, self.dtype)  # after counting (engine.runner.onednn)

    @torch.inference_mode()
    def states(self, rows: list[list[int]], token_types: list[list[int]] | None = None) -> torch.Tensor:
        """Final token states (T, H) of the rows packed in order (sorted longest first by the caller)."""
        lengths = [len(r) for r in rows]
        groups: list[list[int]] = []
        for n in lengths:
            if groups and groups[-1][0] == n:
                groups[-1][1] += 1
            else:
                groups.append([n, 1])
        dev = self.device
        ids = torch.tensor([t for r in rows for t in r], device=dev)[None]
        pos = torch.cat([torch.arange(n, device=dev) for n in lengths])[None] + self._position_offset
        kwargs = {"position_ids": pos, "batchinfer_rows": [tuple(g) for g in groups]}
        if self._token_types:
            types = [t for tt in token_types for t in tt] if token_types else [0] * ids.shape[1]
            kwargs["token_type_ids"] = torch.tensor(types, device=dev)[None]
        return self.body(input_ids=ids, **kwargs).last_hidden_state[0]

    @torch.inference_mode()
    def head(self, pooled: torch.Tensor) -> torch.Tensor:
        """Classification logits (R, num_labels), float32, from pooled rows (R, H)."""
        m, kind = self.model, self.info.model_type
        x = pooled.to(self.dtype)[:, None, :]  # the heads read token 0 of each row
        if kind in ROBERTA_TYPES:
            logits = m.classifier(x)
        elif kind == "modernbert":
            logits = m.classifier(m.drop(m.head(x[:, 0])))
        elif getattr(self.body, "pooler", None) is not None:
            logits = m.classifier(m.dropout(self.body.pooler(x)))
        else:
            logits = m.classifier(x[:, 0])
        return logits.float()
