"""The job spec's schema: validated once, unknown keys rejected, every field documented once.

The engine and sampling sections are derived from `EngineConfig` and `SamplingParams`, so
their defaults and descriptions live in exactly one place. It lives in pipeline/ so that
`build_processor` validates its config with the same rules; jobs.spec reads YAML into it.
Validating a spec imports neither torch nor transformers (engine.api's EngineConfig and
SamplingParams are plain dataclasses).
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from engine.api import DEFAULT_MODEL, EngineConfig, auto_dtype
from engine.api import SamplingParams
from pipeline.errors import SpecError
from pipeline.spec.checks import check_job, check_processor, check_stage
from pipeline.spec.fingerprint import fingerprint
from pipeline.spec.lora import LoRASpec
from pipeline.spec.pooling import EmbedSpec, ScoreSpec
from pipeline.spec.stage import Stage
from pipeline.spec.structured import StructuredOutputsSpec


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _DataclassSection(_Section):
    """A section mirroring an engine dataclass, whose own checks run after pydantic's."""

    own_sections: ClassVar[tuple[str, ...]] = ()
    """Fields that are spec sections checked by their own rules, left out of the dataclass check."""

    @model_validator(mode="after")
    def _dataclass_checks(self):
        self.dataclass_type(**self.model_dump(exclude=set(self.own_sections)))
        return self


def _from_dataclass(name: str, cls, skip: tuple[str, ...], sections: dict | None = None) -> type[BaseModel]:
    """A strict pydantic section mirroring a dataclass: same fields, defaults and docs.
    `sections`: field -> a spec-side type (a section) standing for the dataclass's own type."""
    docs = cls.field_docs()
    hints = {f.name: f.type for f in dataclasses.fields(cls)}
    defs = {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        if f.name in (sections or {}):
            defs[f.name] = (sections[f.name] | None, Field(default=None, description=docs[f.name]))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        annotation = eval(hints[f.name], {"dict": dict, "list": list, "str": str, "int": int,  # noqa: S307
                                          "float": float, "bool": bool, "None": None})
        defs[f.name] = (annotation, Field(default=default, description=docs[f.name]))
    model = create_model(name, __base__=_DataclassSection, **defs)
    model.dataclass_type = cls
    model.own_sections = tuple(sections or ())
    return model


EngineSpec = _from_dataclass("EngineSpec", EngineConfig, skip=("model", "seed", "extra"))
SamplingSpec = _from_dataclass("SamplingSpec", SamplingParams, skip=(),
                               sections={"structured_outputs": StructuredOutputsSpec})
# structured_outputs has a spec-side type: its `json` may name a file, and its grammar compiles in
# preflight, not here (xgrammar imports torch). n > 1 writes one output row per sample.


class FewShotSpec(_Section):
    user: str = Field(description="An example input (a user turn).")
    assistant: str = Field(description="The answer to it (an assistant turn).")


class InputSpec(_Section):
    path: str = Field(description="File, directory or glob; local, file://, s3://, gs:// (any fsspec filesystem).")
    format: Literal["auto", "jsonl", "parquet", "openai_batch"] = Field(
        "auto", description="auto = from the file extension (.jsonl/.json or .parquet); openai_batch = "
        "OpenAI Batch API request lines (custom_id, method, url, body); custom_id is the row id.")
    prompt_column: str | None = Field("prompt", description="Column holding the prompt text.")
    template: str | None = Field(
        None, description="Prompt built from columns, e.g. 'Q: {question}\\nA:' (sandboxed; overrides prompt_column).")
    messages_column: str | None = Field(
        None, description="Column holding chat messages [{role, content}], rendered with the model's chat "
        "template (overrides prompt_column and template).")
    image_column: str | None = Field(
        None, description="Vision-language models: a column of images (bytes, a path or URL string, Hugging Face "
        "datasets' {bytes, path} struct, or a list of them); each row becomes one user message, its images "
        "first, then the prompt text. Not passed to the output unless input.columns names it.")
    system_prompt: str | None = Field(
        None, description="A system message put before every row's messages; the row's prompt then becomes a "
        "user message rendered with the chat template.")
    few_shot: list[FewShotSpec] = Field(
        default_factory=list, description="Example user/assistant turns put before every row (chat template).")
    id_column: str | None = Field(
        None, description="Column with unique row ids; else an id is derived from file + row position.")
    unique_ids: Literal["check", "trust"] = Field(
        "check", description="check = id_column's values are checked unique across the input, beside the work "
        "(the output is complete only once the check passed; a duplicate stops the job naming both places); "
        "trust = not checked (ids from a primary key): a duplicate id then gives two rows for one id.")
    sampling_column: str | None = Field(
        None, description="Column holding a mapping of sampling fields per row (Ray Data LLM's sampling_params), "
        "over the sampling section for that row; a bad one is that row's error.")
    columns: list[str] | None = Field(
        None, description="Input columns copied to the output; None = all of them.")
    on_bad_line: Literal["error", "skip", "fail"] = Field(
        "error", description="A malformed JSONL line: error = an output row with the cause, "
        "skip = left out (counted as skipped), fail = stop the job naming file and line.")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec options for the input filesystem (e.g. endpoint_url).")


class OutputSpec(_Section):
    path: str = Field(description="Output directory; local, file://, s3://, gs://.")
    format: Literal["parquet", "jsonl", "openai_batch"] = Field(
        "parquet", description="Format of the output parts; openai_batch = OpenAI Batch API output lines, plus "
        "output.jsonl and errors.jsonl when the job is complete.")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec options for the output filesystem.")
    lock_stale_after_s: float = Field(
        120.0, gt=0, description="A run lock whose heartbeat is older than this is taken over by a new run.")


class LabelSpec(_Section):
    choices: list[str] | None = Field(
        None, description="Labels to choose from by scoring each one's log-likelihood after the prompt.")
    choices_column: str | None = Field(None, description="Column holding each row's own list of choices.")
    choice_prefix: str | None = Field(
        None, description="Text put before every choice when scoring; None = a space after a plain prompt that "
        "does not end in whitespace, nothing after a chat prompt.")
    length_normalize: bool = Field(
        False, description="Pick the choice with the best mean log-likelihood per token instead of the best sum.")
    label_regex: str | None = Field(
        None, description="Without choices: generate, then take the label from this regex (first group, or the "
        "whole match); no match = null label and a note in `error`.")
    json_schema: dict[str, Any] | str | None = Field(
        None, description="Generate the label as a JSON object this schema constrains (a mapping, or the path or "
        "URL of a .json file, relative to the spec file): `label` holds it as JSON text, `label_fields` a struct "
        "of its top-level properties, typed from the schema.")


class NormalizeSpec(_Section):
    strip: bool = Field(True, description="Trim, and collapse runs of whitespace.")
    lowercase: bool = Field(False, description="Compare case-insensitively.")
    remove_punctuation: bool = Field(False, description="Drop punctuation characters.")


class EvalSpec(_Section):
    reference_column: str | None = Field(None, description="Column with the expected answer (or a list of them).")
    metrics: list[str] = Field(
        default_factory=lambda: ["exact_match"],
        description="Any of exact_match, contains, regex_match (needs answer_regex), accuracy (label vs reference).")
    group_column: str | None = Field(None, description="Column whose values break the metrics down by group.")
    normalize: NormalizeSpec = Field(default_factory=NormalizeSpec,
                                     description="How texts are normalised before comparing.")
    answer_regex: str | None = Field(
        None, description="regex_match: the answer is this regex's first group (or whole match) in the output.")
    k: list[int] | None = Field(
        None, description="sampling.n > 1: metrics.json gives pass@k for each k (each <= n) and maj@n per metric; "
        "None = [1, n].")


class ReportSpec(_Section):
    price_per_hour: float | None = Field(
        None, ge=0, description="Price of one GPU-hour (CPU-core-hour on CPU): adds cost figures to the manifest.")


class WorkersSpec(_Section):
    num: int = Field(1, ge=1, description="Engine actors (one model copy each).")
    gpus: float = Field(0.0, ge=0, description="GPUs per actor (0 = run on CPU); with engine.tensor_parallel_size N "
                        "on GPU it must be N, its default when unset with engine.device cuda.")
    cpus: float = Field(0.5, gt=0, description="CPUs per actor; fractional on CPU so reads can still be scheduled.")
    rows_per_batch: int | None = Field(
        None, ge=1, description="Most rows in one shard (the unit of work, commit and resume); None = shards are "
        "sized by shard_bytes alone.")
    shard_bytes: int = Field(
        1 << 20, ge=1, description="Input bytes per shard (JSONL text; Parquet: uncompressed data): shards end at "
        "the first line end past this, so short rows make few large shards and long rows small ones.")
    resource_wait_s: float = Field(
        600.0, ge=0, description="With an autoscaling cluster, how long to wait for room for one actor "
        "(workers.gpus/cpus) before failing; a fixed cluster that cannot fit one fails at once.")


class StageSpec(_Section):
    """What a row goes through: the model, the task, and every section that changes a row's result. A
    job's spec (JobSpec) is one with the job around it; `build_processor` takes one with its workers
    (ProcessorSpec). How a row becomes a prompt stays in a job's `input` section (JobSpec.stage())."""

    model: str = Field(DEFAULT_MODEL, description="Hugging Face model id (org/name, from the hub cache or "
                       "downloaded; engine.revision picks a branch, tag or commit), model directory (local, s3://, "
                       "gs://...), a .gguf file (local, s3://, gs://, or a Hub repo's as org/repo:Q4_K_M), or a "
                       "builtin: smollm2-135m-instruct (the default, real weights), all-minilm-l6-v2 (embeddings), "
                       "tiny (random weights, for tests). An existing local path wins over an id of the same shape.")
    task: Literal["generate", "label", "eval", "embed", "classify", "score"] = Field(
        "generate", description="generate = text per row; label = a label per row (by choice scoring or "
        "label_regex); eval = generate (or label) and score against a reference, with metrics.json; embed = an "
        "embedding per row; classify = class label and probabilities per row; score = a score per text pair.")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="Generation engine settings.")
    sampling: SamplingSpec = Field(default_factory=SamplingSpec, description="Decoding settings for every row.")
    label: LabelSpec = Field(default_factory=LabelSpec, description="task: label (and eval on choices).")
    eval: EvalSpec = Field(default_factory=EvalSpec, description="task: eval (and classify's accuracy).")
    embed: EmbedSpec = Field(default_factory=EmbedSpec, description="task: embed.")
    score: ScoreSpec = Field(default_factory=ScoreSpec, description="task: score.")
    lora: LoRASpec = Field(default_factory=LoRASpec, description="LoRA adapters, and which rows run under which.")
    seed: int = Field(0, ge=0, description="Job seed: each row's sampling seed is derived from it and the row id.")

    @field_validator("model")
    @classmethod
    def _model_not_empty(cls, v: str) -> str:
        if not v:
            raise ValueError("must not be empty")
        return v

    @model_validator(mode="after")
    def _stage_checks(self):
        check_stage(self)
        return self

    def engine_config(self) -> EngineConfig:
        """The engine's configuration for this stage: its model and seed, and the engine section."""
        engine = self.engine.model_dump()
        engine["enable_lora"] = engine["enable_lora"] or self.lora.active
        return EngineConfig(model=self.model, seed=self.seed, **engine)


class ProcessorSpec(StageSpec):
    """What `build_processor` takes: a stage, and the actors that run it over a Dataset."""

    workers: WorkersSpec = Field(default_factory=WorkersSpec, description="Actors and resources.")

    @model_validator(mode="after")
    def _processor_checks(self):
        check_processor(self)
        return self


class JobSpec(StageSpec):
    """A job: its stage, and around it where the rows come from and go, the actors, the report."""

    input: InputSpec = Field(description="Where the prompts come from.")
    output: OutputSpec = Field(description="Where the results go.")
    workers: WorkersSpec = Field(default_factory=WorkersSpec, description="Actors and resources.")
    report: ReportSpec = Field(default_factory=ReportSpec, description="Cost accounting.")
    max_error_rate: float = Field(
        0.0, ge=0, le=1, description="Fail the job (exit 3) when errors / rows exceeds this.")

    @model_validator(mode="after")
    def _job_checks(self):
        check_job(self)
        return self

    def stage(self) -> Stage:
        """The job's stage as its tasks run it: this spec's stage sections, how a row becomes a prompt
        (the input section), and the formats its rows come in and go out in."""
        inp = self.input
        return Stage(self, inp, inp.sampling_column, requests=inp.format == "openai_batch",
                     lines=self.output.format == "openai_batch", columns=inp.columns)

    def numerics(self) -> dict:
        """The device type and dtype the job's engines compute in, as `auto` resolves them in its
        actors: CUDA when they hold GPUs (workers.gpus > 0), else CPU; bfloat16 on CUDA, float32
        on CPU. Rows depend on them, yet workers.gpus is an execution setting outside the
        fingerprint: an output records them, and a resume must compute as it did."""
        device = self.engine.device
        kind = device.split(":")[0] if device != "auto" else ("cuda" if self.workers.gpus > 0 else "cpu")
        return {"device": kind, "dtype": auto_dtype(kind) if self.engine.dtype == "auto" else self.engine.dtype}

    def fingerprint(self) -> str:
        """Hash of everything that changes the output rows (not of where they are written). A JSON
        Schema counts by its content: one still named by its file raises SpecError."""
        return fingerprint(self, settled=True)

    def accepted_fingerprints(self) -> set[str]:
        """Fingerprints an output of this spec may carry: this version's, and those earlier
        versions gave it while they still counted PLAN_FIELDS, TUNED_FIELDS or SETTLED_FIELDS (as
        set, or with the max_prefill_tokens a user has since renamed max_num_batched_tokens, as
        its warning says)."""
        return {self.fingerprint(), fingerprint(self, planned=False), fingerprint(self, tuned=False, planned=False),
                fingerprint(self, settled=False, tuned=False, planned=False),
                fingerprint(self, settled=False, alias=True, tuned=False, planned=False)}


def validate(data: dict, kind: type[StageSpec] | None = None) -> StageSpec:
    """`data` validated as a JobSpec (or as `kind`, e.g. ProcessorSpec); SpecError names every bad key."""
    kind = kind or JobSpec
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        what = "job spec" if kind is JobSpec else "processor config"
        raise SpecError(f"invalid {what}: " + "; ".join(_describe(e) for e in exc.errors())) from None


def _describe(err: dict) -> str:
    where = ".".join(str(p) for p in err["loc"]) or "(top level)"
    if err["type"] == "extra_forbidden":
        return f"{where}: unknown key"
    if err["type"] == "missing":
        return f"{where}: required"
    msg = err["msg"].removeprefix("Value error, ")
    if not err["loc"]:
        return msg  # a cross-field rule: its message names the keys
    field, _, rest = msg.partition(" ")
    if err["type"] == "value_error" and field.isidentifier() and rest:
        return f"{where}.{field}: {msg}"  # an engine dataclass check names its field first
    return f"{where}: {msg}"


YAML_ORDER = ("model", "task", "input", "output", "engine", "sampling", "workers", "report", "label", "eval", "embed",
              "score", "lora", "max_error_rate", "seed")
"""The job spec's sections in the order its reference lists them (a spec file's order: the stage's
sections and the job's interleave)."""


def field_reference() -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, description) for every field, for `batchinfer spec` and docs."""
    rows = []

    def walk(model: type[BaseModel], prefix: str):
        fields = model.model_fields
        order = YAML_ORDER if model is JobSpec else tuple(fields)
        for name, info in ((name, fields[name]) for name in order):
            ann = info.annotation
            key = prefix + name
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, key + ".")
                continue
            default = "required" if info.is_required() else repr(info.get_default(call_default_factory=True))
            rows.append((key, _type_name(ann), default, info.description or ""))
            optional = [a for a in getattr(ann, "__args__", ()) if isinstance(a, type) and issubclass(a, BaseModel)]
            if optional:  # an optional section (structured_outputs): its own keys too
                walk(optional[0], key + ".")

    walk(JobSpec, "")
    return rows


def _type_name(ann) -> str:
    text = getattr(ann, "__name__", None) if not getattr(ann, "__args__", None) else None
    return text or str(ann).replace("typing.", "")
