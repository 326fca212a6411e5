"""The job's fingerprint: a hash of everything in its spec that changes the output rows, kept in
the output's _job.json so that a rerun with another spec is refused. Outputs of earlier versions
must still resume, which the field lists below keep (see ADDED_FIELDS and SETTLED_FIELDS)."""
from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING

from engine.api import CPU_POOL_TOKENS, EngineConfig
from pipeline.errors import SpecError
from pipeline.spec.structured import schema_file_refs

if TYPE_CHECKING:
    from pipeline.spec.schema import JobSpec

ADDED_FIELDS = (("label",), ("eval",), ("engine", "max_prefill_tokens"), ("input", "messages_column"),
                ("input", "system_prompt"), ("input", "few_shot"), ("engine", "revision"),
                ("engine", "enforce_eager"), ("engine", "enable_prefix_caching"), ("engine", "prefix_cache_tokens"),
                ("workers", "shard_bytes"), ("engine", "kv_cache_dtype"), ("engine", "quantization"),
                ("sampling", "n"), ("sampling", "structured_outputs"), ("label", "json_schema"),
                ("embed",), ("score",), ("engine", "pooling"), ("lora",), ("engine", "enable_lora"),
                ("engine", "structured_outputs_backend"), ("sampling", "logit_bias"), ("sampling", "allowed_token_ids"),
                ("sampling", "bad_words"), ("sampling", "skip_special_tokens"),
                ("sampling", "spaces_between_special_tokens"), ("engine", "max_logprobs"), ("input", "sampling_column"),
                ("sampling", "prompt_logprobs"), ("engine", "gguf_file"), ("engine", "limit_mm_per_prompt"),
                ("engine", "allowed_local_media_path"), ("engine", "allowed_media_domains"),
                ("engine", "max_image_pixels"), ("input", "image_column"))
"""Spec fields added after outputs were first written; left out of the fingerprint at their defaults."""
EXECUTION_FIELDS = ("block_size", "gpu_memory_utilization", "max_num_batched_tokens", "tensor_parallel_size",
                    "distributed_timeout_s", "max_loras", "max_lora_rank", "max_cpu_loras", "strict_kernels",
                    "allowed_media_buckets", "max_image_aspect_ratio")
"""Engine fields that only change how the work is scheduled, never a row: not in the fingerprint
(tensor_parallel_size excepted when quantization is set: the ranks' shards are quantized apart).
The media allow-list and bounds added since are execution fields too: a row they refuse names the
knob, and an output written before them resumes with them set."""
TUNED_FIELDS = {k: EngineConfig.__dataclass_fields__[k].default
                for k in ("max_batch_tokens", "max_num_seqs", "scheduling", "enforce_eager")}
"""Engine fields `batchinfer tune` advises on, which never change a row (tests/engine hold it: the same
tokens in any batch, pool, mode or graph): since 0.4 they count as at their defaults (EngineConfig's),
so a half-finished job resumes with new values; outputs whose fingerprint counted them as set
still resume (`accepted_fingerprints`, and `resumes` through the spec the output recorded)."""
PLAN_FIELDS = ("rows_per_batch", "shard_bytes")
"""Worker fields that cut the input into shards, which never changes a row: since 2026-12-04 they
count as at their defaults, and an output keeps the shard plan it started with (the spec its _job.json
recorded: pipeline.run.shards.planner.shard_plan), so a resume may change them. Outputs whose
fingerprint counted them resume (`accepted_fingerprints`)."""
SETTLED_FIELDS = {"max_prefill_tokens": None, "prefix_cache_tokens": None, "cache_dir": None, "allow_pickle": False}
"""Engine fields earlier versions counted although they never change a row (the deprecated alias
of max_num_batched_tokens, an ignored setting, where and how weights are read): they count as at
these defaults, and an output whose fingerprint counted them as set still resumes
(`accepted_fingerprints`)."""


def fingerprint(spec: JobSpec, settled: bool = True, alias: bool = False, tuned: bool = True,
                planned: bool = True) -> str:
    """The spec's fingerprint; `settled=False`: as earlier versions took it (SETTLED_FIELDS as
    set), with `alias` the deprecated max_prefill_tokens standing for max_num_batched_tokens;
    `tuned=False`: as versions before 0.4 took it (TUNED_FIELDS as set); `planned=False`: as
    versions before 2026-12-04 took it (PLAN_FIELDS as set)."""
    unread = schema_file_refs(spec.model_dump())
    if unread:
        raise SpecError(f"{'.'.join(unread[0][0])}: the schema file {unread[0][1]} must be read before the "
                        "job's fingerprint is taken (pipeline.io.read_schema_files)")
    data = spec.model_dump(mode="json", exclude={"output": {"path", "storage_options", "lock_stale_after_s"},
                                                 "input": {"storage_options", "unique_ids"},
                                                 "workers": {"num", "gpus", "cpus", "resource_wait_s"},
                                                 "report": True, "max_error_rate": True})
    # Pure execution knobs never change output rows: they never count. Quantized, each rank
    # quantizes its own shard (its own scales): the rank count then changes rows. No output of
    # both was ever written before it counted (that combination did not load).
    quantized_tp = data["engine"].get("quantization") is not None and data["engine"]["tensor_parallel_size"] > 1
    if alias and data["engine"].get("max_prefill_tokens") is None:
        data["engine"]["max_prefill_tokens"] = data["engine"].get("max_num_batched_tokens")
    for knob in EXECUTION_FIELDS:
        if not (knob == "tensor_parallel_size" and quantized_tp):
            data["engine"].pop(knob, None)
    if settled:  # counted by earlier versions, though they never change a row: as if at their defaults
        for knob, value in SETTLED_FIELDS.items():
            data["engine"][knob] = value
    if tuned:
        for knob, value in TUNED_FIELDS.items():
            data["engine"][knob] = value
    if data["engine"].get("max_batch_tokens") is None:  # its default until the paged pool: same rows
        data["engine"]["max_batch_tokens"] = CPU_POOL_TOKENS
    # Fields added after 0.1 count only when set, so that outputs of older runs still resume
    # (inner fields first: a section whose added fields are all unset compares as before).
    defaults = type(spec)(input={"path": "-"}, output={"path": "-"}).model_dump(mode="json")
    if planned:
        for knob in PLAN_FIELDS:
            data["workers"][knob] = defaults["workers"][knob]
    for values in (data, defaults):  # metrics.json only, recomputed from the committed rows: never a row
        values["eval"].pop("k")
        # which adapters a job serves, and their files, are checked name by name against the output's
        # _job.json (pipeline.run.checks.adapters): an adapter added to a lora.each job computes only its rows
        for key in ("adapters", "path", "storage_options"):
            values["lora"].pop(key)
    for path in sorted(ADDED_FIELDS, key=len, reverse=True):
        *parents, leaf = path
        node, default = data, defaults
        for key in parents:
            node, default = node[key], default[key]
        if leaf in node and node[leaf] == default[leaf]:
            del node[leaf], default[leaf]
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

