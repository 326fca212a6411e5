"""The only place that runs the model: loads it, and runs one forward pass over a batch."""
from __future__ import annotations

import inspect
import logging
import os
from dataclasses import replace

import numpy as np
import torch

from engine.api.config import EngineConfig
from engine.api.errors import ModelLoadError, one_line
from engine.core.scheduler import ScheduledChunk
from engine.distributed import tensor_parallel
from engine.distributed.ranks import RankGroup, join_as_rank, rank_device
from engine.lora.model import LoRAModel
from engine.models.files import load_tokenizer, read_config, resolve_model_dir
from engine.multimodal import vision_features
from engine.quantization.checkpoints import PackedFormat, checkpoint_config, stored_format
from engine.quantization.methods import check_method, checkpoint_method, quantize_model, resolve_method, weights_nbytes
from engine.runner.attention import PassMetadata
from engine.runner.fast_paths import FastPaths, check_quantized
from engine.runner.devices import resolve_device, resolve_dtype, resolve_kv_dtype
from engine.runner.kv_cache import PagedKVCache
from engine.runner.loader import (check_architecture, load_model, load_model_quantized, model_head,
                                  prepare_load)
from engine.runner.memory import LoadPeak, used_before_load
from engine.runner.onednn import pack_linears, pack_lm_head
from engine.runner.pass_inputs import PassInputs, build_inputs
from engine.runner.rope import rowwise_longrope

log = logging.getLogger(__name__)


class ModelRunner:
    """Holds the model and tokenizer and runs forward passes over the paged KV pool.

    A pass packs its chunks into one sequence (batch size 1, T tokens) with each token's own
    position; attention (`engine.runner.attention`, registered with transformers) reads each row's
    blocks, so no mask is built and no padding is computed."""

    def __init__(self, config: EngineConfig, rank: int = 0):
        self.rank = rank
        """This process's tensor-parallel rank (0: the engine's own, which samples)."""
        self.tensor_parallel_size = config.tensor_parallel_size
        self.ranks: RankGroup | None = None
        """Rank 0's handle on the other ranks (tensor_parallel_size > 1), else None."""
        self.device = rank_device(resolve_device(config.device), rank)
        self.memory_before_load = used_before_load(self.device) if self.device.type == "cuda" else None
        """(Bytes of the card in use outside torch's allocator, bytes of live tensors) before the
        weights loaded: engine.runner.memory sizes the pool apart from them."""
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.device)
        self.model_dir = resolve_model_dir(config)
        self.hf_tokenizer = load_tokenizer(config, self.model_dir) if rank == 0 else None
        try:
            hf_config = read_config(config, self.model_dir)
            checkpoint, loads_as = checkpoint_method(hf_config)
            self.vision = vision_features(hf_config, config)
            """A vision-language model's image embeddings (engine.multimodal), else None."""
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from None
        self.checkpoint_quantization = checkpoint
        """The checkpoint's own quantization (as its config names it), or None."""
        self.quantization = resolve_method(config.quantization, checkpoint, loads_as, self.device)
        """The method the engine runs its linear layers with (None: the model's dtype)."""
        check_method(self.quantization, self.device)
        self.head = model_head(hf_config)
        """causal (an LM head), classifier (a decoder's sequence-classification head) or base (none)."""
        if self.head != "causal" and self.tensor_parallel_size > 1:
            raise ModelLoadError(f"{self.head} decoder models (no LM head) run with tensor_parallel_size 1")
        self.shard: tuple | None = None
        """(tp styles, fused sections, rank, n) under tensor parallelism (how LoRA shards adapters)."""
        prepare_load(config, self.model_dir)  # its imports (~200 MiB of modules) before the peak is taken
        peak = LoadPeak(self.device)
        with peak:
            self._load_weights(config, hf_config, checkpoint)
        self.load_peak_bytes = peak.bytes
        """What loading the weights added at its peak (engine.runner.memory.LoadPeak): on CPU the
        resident high-water mark over the memory before, on CUDA the allocator's peak."""
        self.rank_loads: list[dict] = getattr(self, "rank_loads", [])
        """Under tensor parallelism, on rank 0: each other rank's weights_bytes and load_peak_bytes,
        as the rank measured them in its own process."""
        text_config = self.model.config.get_text_config(decoder=True)
        self.num_layers: int = text_config.num_hidden_layers
        head = self.model.get_output_embeddings() if self.head == "causal" else None
        self.vocab_size: int = (getattr(head, "out_features", None) or head.weight.shape[0] if head is not None
                                else text_config.vocab_size)
        self.max_position_embeddings: int | None = (
            getattr(text_config, "max_position_embeddings", None) or getattr(text_config, "n_positions", None))
        self.sliding_window: int | None = getattr(text_config, "sliding_window", None)
        layer_types = set(getattr(text_config, "layer_types", None) or ())
        if layer_types and "sliding_attention" not in layer_types:
            self.sliding_window = None  # a window in the config that no layer uses
        self.all_sliding = bool(self.sliding_window) and (not layer_types or layer_types == {"sliding_attention"})
        """Every layer attends within the window (then positions before it are never read)."""
        pack_lm_head(self.model, self.device, self.dtype)
        self.longrope = rowwise_longrope(self.model)
        self.weights_nbytes = weights_nbytes(self.model)
        """Bytes of the model's weights as held (quantized values and scales; tied ones once)."""
        self.unquantized_nbytes: int = getattr(self, "unquantized_nbytes", self.weights_nbytes)
        """What the weights would hold unquantized, in the model's dtype (set by _quantize): the
        difference is what quantizing saved."""
        self.paths = FastPaths(config.strict_kernels)  # which fast paths it checked, which fell back
        if self.quantization:
            check_quantized(self.model, self.quantization, self.dtype, self.paths)
        self.packed_linears: int = pack_linears(self.model, self.device, self.dtype)
        """Linear layers running on oneDNN-reordered weights (engine.runner.onednn; CPU float32),
        after weights_nbytes was counted: a reordered weight has no storage to count."""
        params = inspect.signature(self.model.forward).parameters
        # transformers 5 renamed past_key_values to cache; accept either.
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        if "position_ids" not in params:
            raise ModelLoadError(f"{type(self.model).__name__} takes no position_ids: the engine packs rows into "
                                 "one sequence and cannot give it each token's position")
        self._takes_logits_to_keep = "logits_to_keep" in params
        self.graphs = None
        """engine.runner.cuda_graph.DecodeGraphs once enabled (LLMEngine: CUDA, unless enforce_eager)."""
        self.lora = (LoRAModel(config, self.model, self.device, self.dtype, self.shard, self.paths)
                     if config.enable_lora else None)
        """Adapters read and installed in device slots (enable_lora), else None."""

    def _load_shard(self, config: EngineConfig, hf_config, checkpoint: str | None, packed):
        """This rank's shard (quantized after sharding: each shard's own per-channel scales); rank 0
        starts the other ranks first (after the checks that need none) and waits for their shards."""
        from engine.runner import attention

        n = self.tensor_parallel_size
        check_architecture(hf_config)
        if config.extra:
            raise ModelLoadError(f"tensor_parallel_size {n} builds each shard itself: engine.extra "
                                 f"({', '.join(sorted(config.extra))}) would not be applied; remove it")
        styles = tensor_parallel.check_shardable(hf_config, n)
        self.shard = (styles, tensor_parallel.fused_sections(hf_config, n), self.rank, n)
        if self.device.type == "cuda" and torch.cuda.device_count() < n:
            raise ModelLoadError(f"tensor_parallel_size {n} needs {n} visible GPUs, torch sees "
                                 f"{torch.cuda.device_count()}")
        if self.rank == 0:
            self.ranks = RankGroup.start(replace(config, model=str(self.model_dir), tokenizer=None), self.device,
                                         rank_main)
        try:
            model = self._streamed_or_whole(
                lambda: load_model_quantized(config, self.model_dir, self.dtype, self.device, self.quantization,
                                             self.head, packed, self.shard),
                lambda: tensor_parallel.load_shard(self.model_dir, hf_config, attention.register(), self.dtype,
                                                   self.device, self.rank, n, config.trust_remote_code),
                checkpoint, must_stream=packed is not None)  # (sliced as plain tensors otherwise)
            tensor_parallel.add_all_reduce(model)
            if self.ranks is not None:
                # loading a shard takes what it takes; a dead rank fails
                self.rank_loads = [load for _, load in sorted(self.ranks.wait_for("ready", None).items())]
        except BaseException as exc:
            if self.ranks is not None:
                error = self.ranks.failure(exc, in_pass=False)
                if error is not exc and isinstance(exc, Exception):
                    raise error from exc
            raise
        return model

    def _load_weights(self, config: EngineConfig, hf_config, checkpoint: str | None) -> None:
        """self.model: quantized layer by layer as it is read where it can be, else loaded whole
        (then quantized), or this rank's shard under tensor parallelism."""
        self.streamed = False
        """Whether the weights were quantized layer by layer as they were read."""
        packed = stored_format(checkpoint_config(hf_config)) if checkpoint is not None else None
        if self.tensor_parallel_size > 1:
            self.model = self._load_shard(config, hf_config, checkpoint, packed)
            return
        self.model = self._streamed_or_whole(
            lambda: load_model_quantized(config, self.model_dir, self.dtype, self.device, self.quantization,
                                         self.head, packed),
            lambda: load_model(config, self.model_dir, self.dtype, self.device, checkpoint,
                               "vision" if self.vision is not None else self.head),
            checkpoint, must_stream=isinstance(packed, PackedFormat))  # 4-bit layers: nothing else reads them

    def _streamed_or_whole(self, stream, whole, checkpoint: str | None, must_stream: bool):
        """The model quantized as it is read (stream()) where it runs quantized and can be, else
        loaded whole (whole()) and then quantized."""
        loaded = stream() if self.quantization is not None else None
        if loaded is not None:
            (model, self.unquantized_nbytes), self.streamed = loaded, True
            return model
        if must_stream:
            raise ModelLoadError(f"{self.model_dir}: a {checkpoint} checkpoint loads from safetensors files with the "
                                 "model's own tensor names")
        model = whole()
        self._quantize(model)
        return model

    def close(self) -> None:
        """Stops the other ranks (tensor_parallel_size > 1); idempotent."""
        if self.ranks is not None:
            self.ranks.close()

    def _quantize(self, model) -> None:
        """Quantizes the linear layers when the engine runs quantized; first notes what the
        weights hold unquantized."""
        if self.quantization is None:
            return
        self.unquantized_nbytes = weights_nbytes(model)
        quantize_model(model, self.quantization, self.dtype)

    def release_cached_memory(self) -> None:
        """Gives the blocks torch's CUDA allocator caches back to the card (after an out-of-memory
        pass, so the next pass finds them)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def eos_token_ids(self) -> set[int]:
        """EOS ids from the generation config (as transformers' generate uses them)."""
        eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if eos is None:
            eos = getattr(self.model.config, "eos_token_id", None)
        if eos is None:
            return set()
        return set(eos) if isinstance(eos, (list, tuple)) else {eos}

    # -- forward passes -----------------------------------------------------------------------

    def make_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        """A KV pool of this rank (its KV heads' share of every token)."""
        return PagedKVCache(self.num_layers, num_blocks, block_size, self.kv_dtype, self.paths)

    def new_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        """A KV pool, created on every rank (`key` names it in their commands)."""
        cache = self.make_cache(num_blocks, block_size)
        if self.ranks is not None:
            cache.key = self.ranks.new_key()
            self.ranks.send("cache", cache.key, num_blocks, block_size)
        return cache

    def load_lora(self, slot: int, request) -> None:
        """Installs an adapter (a LoRARequest) in device slot `slot`, on every rank."""
        if self.ranks is not None:
            self.ranks.send("lora", slot, self.lora.local(request))
        self.lora.install(slot, request)

    def drop_cache(self, cache: PagedKVCache) -> None:
        if self.ranks is not None:
            self.ranks.send("drop", cache.key)

    def copy_block(self, cache: PagedKVCache, src: int, dst: int) -> None:
        """Block dst of the pool becomes a copy of block src, on every rank."""
        if self.ranks is not None:
            self.ranks.send("copy", cache.key, src, dst)
        cache.copy_block(src, dst)

    def metadata(self, chunks: list[ScheduledChunk], block_size: int) -> tuple[PassMetadata, list[int], np.ndarray]:
        """The pass's pool addressing, plus its input tokens (a host list) and positions."""
        inputs = self.pass_inputs(chunks, block_size)
        return self._device_metadata(inputs), inputs.tokens, inputs.positions

    def pass_inputs(self, chunks: list[ScheduledChunk], block_size: int, keep: list[int] | None = None,
                    all_logits: bool = False) -> PassInputs:
        """Everything a forward pass over `chunks` needs, as host arrays (sent to the other ranks)."""
        return build_inputs(chunks, block_size, keep, all_logits, self.longrope)

    def _device_metadata(self, inputs: PassInputs) -> PassMetadata:
        dev = self.device
        return PassMetadata(
            slot_mapping=torch.from_numpy(inputs.slots).to(dev), block_tables=torch.from_numpy(inputs.tables).to(dev),
            token_row=torch.from_numpy(inputs.rows).to(dev), ctx=torch.from_numpy(inputs.ctx).to(dev),
            max_ctx=inputs.max_ctx, small=None if inputs.small is None else torch.from_numpy(inputs.small).to(dev),
            chunks=inputs.spans)

    @torch.inference_mode()
    def run(self, cache: PagedKVCache, chunks: list[ScheduledChunk], keep: list[int] | None = None,
            all_logits: bool = False) -> torch.Tensor | None:
        """One forward pass over `chunks` (on every rank). Returns float32 logits (k, V) at the last
        token of each chunk that samples (or at token indices `keep`), or (T, V) with all_logits."""
        inputs = self.pass_inputs(chunks, cache.block_size, keep, all_logits)
        if self.ranks is None:
            return self.forward(cache, inputs)
        self.ranks.send("run", cache.key, inputs)
        try:
            return self.forward(cache, inputs)
        except BaseException as exc:  # the ranks are mid-pass or gone: none can be resumed
            error = self.ranks.failure(exc)
            if not isinstance(exc, Exception):
                raise  # Ctrl-C stays a KeyboardInterrupt (the ranks are stopped all the same)
            raise error from exc

    @torch.inference_mode()
    def forward(self, cache: PagedKVCache, inputs: PassInputs) -> torch.Tensor | None:
        """The pass of `inputs` on this rank's shard; logits on rank 0 (None on the others, or
        when no token is kept). A decode pass replays a CUDA graph where one serves it."""
        if self.graphs is not None and inputs.lora_slots is None and self.graphs.eligible(inputs):
            logits = self.graphs.run(cache, inputs)
            if logits is not None:
                return logits
        meta = self._device_metadata(inputs)
        keep = inputs.keep
        if self.longrope is not None:
            self.longrope.long_tokens = None if inputs.long_tokens is None else torch.from_numpy(
                inputs.long_tokens).to(self.device)
        index = None if keep is None else torch.tensor(keep, dtype=torch.int64, device=self.device)
        wanted = index if keep is None or keep else torch.zeros(1, dtype=torch.int64, device=self.device)
        if self.lora is not None:
            self.lora.context.begin(inputs.lora_slots)
        try:
            logits = self.model_logits(cache, meta, torch.tensor([inputs.tokens], device=self.device),
                                       inputs.position_ids(self.device), wanted, inputs.images)
        finally:
            if self.lora is not None:
                self.lora.context.end()
        if self.rank or (index is not None and not len(keep)):
            return None
        if index is not None and not self._takes_logits_to_keep:
            logits = logits[index]
        return logits.float()

    @torch.inference_mode()
    def hidden_states(self, cache: PagedKVCache, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Final hidden states (T, H), float32, of every token of `chunks` (their keys and values
        written to the pool as any pass writes them): the decoder's body without its head."""
        if self.ranks is not None:
            raise ModelLoadError("pooling runs with tensor_parallel_size 1")
        inputs = self.pass_inputs(chunks, cache.block_size, all_logits=True)
        meta = self._device_metadata(inputs)
        if self.longrope is not None:
            self.longrope.long_tokens = None if inputs.long_tokens is None else torch.from_numpy(
                inputs.long_tokens).to(self.device)
        kwargs = {self._cache_kwarg: cache, "use_cache": True, "batchinfer_pass": meta, "batchinfer_cache": cache,
                  "position_ids": inputs.position_ids(self.device)}
        cache.meta = meta
        if self.lora is not None:
            self.lora.context.begin(inputs.lora_slots)
        try:
            out = self.model.base_model(input_ids=torch.tensor([inputs.tokens], device=self.device), **kwargs)
        finally:
            cache.meta = None
            if self.lora is not None:
                self.lora.context.end()
        return out.last_hidden_state[0].float()

    def model_logits(self, cache: PagedKVCache, meta: PassMetadata, input_ids: torch.Tensor,
                     position_ids: torch.Tensor, keep: torch.Tensor | None = None, images=None) -> torch.Tensor:
        """The model's forward over one packed pass: input_ids, position_ids (1, T) or (3, 1, T)
        with M-RoPE, on the device. Returns its logits (k, V) in the model's dtype: at indices `keep`
        where the model takes logits_to_keep, else at every token. `images` (PassInputs.images): the
        image placeholders' embeddings come from the vision tower (engine.multimodal.VisionFeatures)."""
        kwargs = {self._cache_kwarg: cache, "use_cache": True, "batchinfer_pass": meta, "batchinfer_cache": cache,
                  "position_ids": position_ids}
        if images:
            kwargs["inputs_embeds"], input_ids = self.vision.embed(self.model, input_ids, images), None
        if keep is not None and self._takes_logits_to_keep:
            kwargs["logits_to_keep"] = keep
        cache.meta = meta
        try:
            return self.model(input_ids=input_ids, **kwargs).logits[0]
        finally:
            cache.meta = None

    def enable_graphs(self, max_rows: int, max_blocks: int, capture: bool = True) -> None:
        """Decode passes of up to `max_rows` rows holding up to `max_blocks` blocks each replay
        CUDA graphs (engine.runner.cuda_graph). `capture=False` runs the same static-buffer passes
        eagerly (the CPU tests' way of checking them)."""
        from engine.runner.cuda_graph import DecodeGraphs

        self.graphs = DecodeGraphs(self, max_rows, max_blocks, capture=capture)


def rank_main(config: EngineConfig, rank: int, port: int, conn, parent: int, threads: int) -> None:
    """A tensor-parallel rank's process (spawned by rank 0): loads its shard, then runs rank 0's
    commands until told to close or rank 0 is gone. A failure is sent to rank 0, which names it."""
    try:
        conn.send(("hello", None))
        join_as_rank(config, rank, port, parent, threads, rank_device(resolve_device(config.device), rank))
        runner = ModelRunner(config, rank=rank)
        conn.send(("ready", {"weights_bytes": runner.weights_nbytes, "load_peak_bytes": runner.load_peak_bytes}))
        serve(runner, conn)
    except (EOFError, KeyboardInterrupt):  # rank 0 is gone, or Ctrl-C reached the process group
        pass
    except BaseException as exc:  # noqa: BLE001
        try:
            conn.send(("error", one_line(exc)))
        except OSError:
            pass
        os._exit(1)
    os._exit(0)  # no interpreter teardown: a collective's thread must not keep a finished rank alive


def serve(runner: ModelRunner, conn) -> None:
    """Runs rank 0's commands until it says close (or its pipe closes: EOFError)."""
    caches: dict[int, PagedKVCache] = {}
    while True:
        command, *args = conn.recv()
        if command == "run":
            runner.forward(caches[args[0]], args[1])
        elif command == "cache":
            caches[args[0]] = runner.make_cache(*args[1:])
        elif command == "drop":
            caches.pop(args[0], None)
        elif command == "lora":
            runner.lora.install(*args)
        elif command == "copy":
            caches[args[0]].copy_block(*args[1:])
        elif command == "close":
            return
