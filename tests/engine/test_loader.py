"""Model loading: builtin models, safetensors-only by default, clear one-line errors."""
from __future__ import annotations

import hashlib

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.models.builtin import builtin_path
from engine import ModelLoadError


def digest(path):
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_builtin_tiny_is_deterministic_and_built_once(tmp_path):
    a = builtin_path("builtin:tiny", tmp_path / "a")
    b = builtin_path("builtin:tiny", tmp_path / "b")
    assert digest(a) == digest(b)
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert builtin_path("builtin:tiny", tmp_path / "a") == a
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime


def test_unknown_builtin_is_named():
    with pytest.raises(ValueError, match="unknown builtin model 'builtin:huge'.*builtin:tiny"):
        builtin_path("builtin:huge")


def test_missing_model_dir_fails_with_one_line(tmp_path):
    with pytest.raises(ModelLoadError, match="model directory not found"):
        LLMEngine(EngineConfig(model=str(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        LLMEngine(EngineConfig(model=str(tmp_path / "empty")))


def test_pickle_weights_need_explicit_opt_in(tiny_model_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file

    src = tiny_model_dir("llama")
    pickled = tmp_path / "pickled"
    shutil.copytree(src, pickled)
    state = load_file(pickled / "model.safetensors")
    (pickled / "model.safetensors").unlink()
    torch.save(state, pickled / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="allow_pickle"):
        LLMEngine(EngineConfig(model=str(pickled)))
    llm = LLMEngine(EngineConfig(model=str(pickled), allow_pickle=True))
    safe = LLMEngine(EngineConfig(model=str(src)))
    assert llm.generate(["same"], None)[0].token_ids == safe.generate(["same"], None)[0].token_ids


def test_max_model_len_defaults_to_the_model_and_cannot_exceed_it():
    assert LLMEngine(EngineConfig(model="builtin:tiny")).max_model_len == 4096
    with pytest.raises(ValueError, match="max_model_len"):
        LLMEngine(EngineConfig(model="builtin:tiny", max_model_len=10_000))


def test_auto_dtype_and_device_on_cpu():
    llm = LLMEngine(EngineConfig(model="builtin:tiny"))
    if not torch.cuda.is_available():
        assert llm.runner.device.type == "cpu" and llm.runner.dtype == torch.float32


def test_a_model_on_object_storage_is_copied_to_the_cache_first(tiny_model_dir, s3_server, tmp_path):
    import s3fs

    src = tiny_model_dir("llama")
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server})
    fs.mkdir("models")
    for f in src.iterdir():
        fs.put_file(str(f), f"models/tiny-llama/{f.name}")
    cache = tmp_path / "cache"
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = LLMEngine(EngineConfig(model=str(src))).generate(["from s3"], params)[0].token_ids
    remote = LLMEngine(EngineConfig(model="s3://models/tiny-llama", cache_dir=str(cache)))
    assert remote.generate(["from s3"], params)[0].token_ids == expected
    copy, = [p for p in (cache / "models").iterdir() if not p.name.startswith(".")]  # beside it: its file lock
    assert sorted(p.name for p in copy.iterdir()) == sorted([p.name for p in src.iterdir()] + [".complete"])
    assert digest(copy) == digest(src)
    fs.rm("models/tiny-llama", recursive=True)  # from now on the cached copy is used
    again = LLMEngine(EngineConfig(model="s3://models/tiny-llama/", cache_dir=str(cache)))
    assert again.generate(["from s3"], params)[0].token_ids == expected
    with pytest.raises(ModelLoadError, match="no files under s3://models/not-there"):
        LLMEngine(EngineConfig(model="s3://models/not-there", cache_dir=str(cache)))


def _without(src, out, *names):
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    tensors = load_file(out / "model.safetensors")
    for name in names:
        del tensors[name]
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_a_checkpoint_missing_a_parameter_is_refused_naming_it(tiny_model_dir, tmp_path, quantization):
    """transformers initialises a missing parameter at random and only logs it: a classifier
    without its head returned random probabilities with error None. The whole load and the
    streaming one (which fell back to the whole load on a missing name) refuse it, naming it."""
    from pooling_models import build_classifier

    from engine import ModelLoadError

    clf = _without(build_classifier(tmp_path / "clf", "qwen2"), tmp_path / "headless", "score.weight")
    with pytest.raises(ModelLoadError, match=r"misses score\.weight") as err:
        LLMEngine(EngineConfig(model=str(clf), quantization=quantization))
    assert "\n" not in str(err.value)
    normless = _without(tiny_model_dir("llama"), tmp_path / "normless", "model.norm.weight",
                        "model.layers.1.mlp.down_proj.weight")
    with pytest.raises(ModelLoadError, match=r"misses model\.layers\.1\.mlp\.down_proj\.weight, model\.norm\.weight"):
        LLMEngine(EngineConfig(model=str(normless), quantization=quantization))


def test_a_local_models_identity_is_its_files_content(tiny_model_dir, tmp_path):
    import shutil

    from engine.models import model_identity

    src = tiny_model_dir("llama")
    moved = tmp_path / "elsewhere"
    shutil.copytree(src, moved)
    here, there = model_identity(EngineConfig(model=str(src))), model_identity(EngineConfig(model=str(moved)))
    assert here == there and here["kind"] == "files" and here["id"].startswith("sha256:")  # not where it lies
    (moved / "generation_config.json").write_text('{"note": "rewritten"}')
    assert model_identity(EngineConfig(model=str(moved))) != here
    assert model_identity(EngineConfig(model="builtin:tiny")) == {"kind": "builtin", "id": "builtin:tiny"}
    assert LLMEngine(EngineConfig(model=str(src))).model_identity() == here
