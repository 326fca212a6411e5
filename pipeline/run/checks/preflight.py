"""Checks before any actor starts: one line, at once, for problems that would doom every actor.

Used by `run_job` before it claims the output, and by `batchinfer validate`. The spec's grammars
(sampling.structured_outputs, label.json_schema) compile here against the model's tokenizer: the
torch-free `validate` of the schema cannot (xgrammar imports torch).
"""
from __future__ import annotations

from collections.abc import Callable

from engine.api import EngineConfig, ModelLoadError, one_line
from engine.api import StructuredOutputsParams
from pipeline.errors import InputError, JobError, TemplateError
from pipeline.io import Storage, list_inputs, read_first_value, read_schema_columns
from pipeline.spec import JobSpec
from pipeline.tasks import PromptBuilder


def preflight(spec: JobSpec, say: Callable[[str], None] | None = None) -> list[tuple[str, str, str]]:
    """Raises JobError on inputs that cannot be listed or read, a template that does not parse,
    an input column the job needs that the first file lacks, or a model that will not load.
    Returns the input files."""
    inp = spec.input
    try:
        storage = Storage(inp.path, inp.storage_options)
        files = list_inputs(storage, inp.format)
        builder = PromptBuilder.from_spec(inp)
        path, name, fmt = files[0]
        columns = read_schema_columns(storage, path, fmt)
    except (InputError, TemplateError) as exc:
        raise JobError(str(exc)) from None
    except (OSError, ValueError, ImportError) as exc:
        raise JobError(f"cannot read input {inp.path}: {one_line(exc)}") from None
    needed = input_columns(spec, builder)
    absent = [c for c in needed if c not in columns]
    if columns and absent:
        raise JobError(f"input column {absent[0]!r} not found in {name} (columns: {', '.join(columns)})")
    if inp.image_column:
        check_image_sample(spec, storage, path, name, fmt)
    # OpenAI Batch lines each say what they ask (a line the model cannot serve fails alone)
    tokenizer = check_model(spec.engine_config(), None if spec.input.format == "openai_batch" else spec.task)
    # (rows with images are rendered by the model's processor, whose chat template the tokenizer may not hold)
    if builder.chat and not inp.image_column and not getattr(tokenizer, "chat_template", None):
        raise JobError(f"model {spec.model}: its tokenizer has no chat template, so input.messages_column, "
                       "system_prompt and few_shot cannot be rendered (use a plain prompt, or a chat model)")
    for line in check_constraints(spec, tokenizer):
        if say is not None:
            say(line)
    return files


def spec_constraints(spec: JobSpec) -> list[tuple[str, StructuredOutputsParams]]:
    """(spec key, constraint) of every grammar the job's rows generate under."""
    found = []
    if spec.sampling.structured_outputs is not None:
        found.append(("sampling.structured_outputs", spec.sampling.structured_outputs.params()))
    if spec.task in ("label", "eval") and spec.label.json_schema is not None:
        found.append(("label.json_schema", StructuredOutputsParams(json=spec.label.json_schema)))
    return found


def check_constraints(spec: JobSpec, tokenizer) -> list[str]:
    """Compiles the job's grammars against `tokenizer`: JobError naming the key and the cause when
    one is invalid or too slow to compile (engine.structured.COMPILE_TIMEOUT_S). Returns a line
    per constraint: the backend that runs it and what is only checked after generation."""
    constraints = spec_constraints(spec)
    if not constraints:
        return []
    from engine.structured import GrammarBackend  # imports torch and xgrammar: only when there is a grammar

    eos = getattr(tokenizer, "eos_token_id", None)
    backend = GrammarBackend(tokenizer, len(tokenizer), {eos} if isinstance(eos, int) else set(),
                             backend=spec.engine.structured_outputs_backend)
    lines = []
    for key, params in constraints:
        where = f"{key}.{params.kind}" if key == "sampling.structured_outputs" else key
        try:
            compiled = backend.compile(params)
        except ValueError as exc:
            cause = str(exc).removeprefix(f"structured_outputs.{params.kind}: ")
            raise JobError(f"{where}: {cause}") from None
        lines.append(f"{where}: {compiled.route.note()}")
    return lines


def input_columns(spec: JobSpec, builder: PromptBuilder) -> list[str]:
    """Input columns every row needs: the prompt's, the id's, and the task's."""
    inp = spec.input
    if inp.format == "openai_batch":
        return ["custom_id", "body"]
    columns = [spec.score.text_1_column, spec.score.text_2_column] if spec.task == "score" else builder.columns
    needed = columns + [c for c in (inp.id_column, inp.sampling_column) if c]
    if spec.task in ("label", "eval") and spec.label.choices_column:
        needed.append(spec.label.choices_column)
    if spec.task in ("eval", "classify"):
        needed += [c for c in (spec.eval.reference_column, spec.eval.group_column) if c]
    return needed


def check_image_sample(spec: JobSpec, storage: Storage, path: str, name: str, fmt: str) -> None:
    """The first row's image decodes under the engine's media policy (a JobError naming the file
    otherwise: a column of something else fails here, not row by row)."""
    from engine.multimodal import load_image, media_policy

    column = spec.input.image_column
    value = read_first_value(storage, path, fmt, column)
    if value is None:
        return
    policy = media_policy(spec.engine_config())
    try:
        for source in value if isinstance(value, list) else [value]:
            load_image(source, policy)
    except ValueError as exc:
        raise JobError(f"input.image_column {column!r}: the first row of {name} holds no readable image: {exc}") from None


def check_model(config: EngineConfig, task: str | None = "generate"):
    """Resolves the model (a Hub model's config and tokenizer files only), checks its weights,
    that it can serve `task` (a classifier cannot generate, an embedder cannot classify), and loads
    its tokenizer (no weights). Returns the tokenizer."""
    from engine import ECHO_MODEL, EchoEngine  # the engine's modules import torch: only when checked
    from engine.models import check_model_files, load_tokenizer, model_pooling_info

    if config.model == ECHO_MODEL:
        return EchoEngine(config).tokenizer.hf
    try:
        path = check_model_files(config)
        info = model_pooling_info(path, config.pooling)
        info.check_engine(config.quantization, config.tensor_parallel_size)  # before a job reserves GPUs per rank
        if config.tensor_parallel_size > 1 and info.kind != "encoder":
            from engine.distributed import check_shardable
            from engine.models import read_config

            check_shardable(read_config(config, path), config.tensor_parallel_size)  # heads the ranks cannot split
        if task is not None:
            info.check("generate" if task in ("label", "eval") else task)
        return load_tokenizer(config, path)
    except (ModelLoadError, ValueError) as exc:
        message = str(exc)  # Hub errors name the id already
        raise JobError(message if config.model in message else f"model {config.model}: {message}") from None
