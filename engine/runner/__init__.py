"""Running the model: loading it onto its device, one packed forward pass over the paged KV pool
(attention and its kernels, rotary scalings, CUDA graphs) and sizing that pool from the card."""
from engine.runner.attention import PassMetadata, chunk_attention, reference_token_attention
from engine.runner.devices import resolve_device, resolve_dtype, resolve_kv_dtype
from engine.runner.kv_cache import PagedKVCache
from engine.runner.loader import adapter_targets, check_architecture, import_apart, load_model
from engine.runner.memory import keep_cpu_buffers, profile_pool_blocks
from engine.runner.model_runner import ModelRunner, PassInputs

__all__ = ["ModelRunner", "PassInputs", "PassMetadata", "PagedKVCache", "load_model", "import_apart", "check_architecture", "adapter_targets",
           "resolve_device", "resolve_dtype", "resolve_kv_dtype", "keep_cpu_buffers", "profile_pool_blocks",
           "chunk_attention", "reference_token_attention"]
