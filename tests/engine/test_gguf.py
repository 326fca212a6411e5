"""GGUF checkpoints: each family's file converts to the weights transformers' own GGUF load gives,
every tensor type dequantizes as transformers' independent dequantizer does, the engine's greedy
tokens on a GGUF equal transformers' on the same file, the conversion is cached (never redone,
never rehashed), preflight reads the header only, and bad files are refused in one line."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import EngineConfig, LLMEngine, ModelLoadError, SamplingParams
from engine.models import gguf
from engine.models.files import check_model_files, resolve_model_dir
from gguf_models import GGUF_ARCH, write_gguf

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 72, 101, 108, 108, 111], [1, 84, 104, 101, 32, 99, 97, 116, 32, 115, 97, 116], [1, 50, 43, 50, 61]]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """family -> (its .gguf, the Hugging Face directory it was written from), written once."""
    out = tmp_path_factory.mktemp("gguf")
    made = {}

    def get(family: str, **kw):
        key = (family, tuple(sorted(kw.items())))
        if key not in made:
            where = out / f"{family}-{len(made)}"
            where.mkdir()
            made[key] = write_gguf(family, where, **kw)
        return made[key]

    return get


def _state(model) -> dict:
    return {k: v for k, v in model.state_dict().items()}


@pytest.mark.parametrize("family", [f for f in GGUF_ARCH if f not in ("qwen3", "mistral")])
def test_each_family_converts_to_the_weights_transformers_gguf_load_gives(files, tmp_path, family):
    path, _ = files(family)
    converted = gguf.converted_dir(path, tmp_path, "float32")
    ours = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    assert type(ours) is type(theirs)
    a, b = _state(ours), _state(theirs)
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    record = gguf.converted_from(converted)
    assert record["file"] == path.name and set(record["tensor_types"]) == {"F32", "F16", "Q8_0", "Q4_0", "Q4_1",
                                                                           "Q5_0", "Q5_1"}


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_files_transformers_own_gguf_load_fails_on_convert_to_the_model_they_were_written_from(files, tmp_path,
                                                                                            family):
    """transformers' own GGUF load fails on these two: it leaves Qwen3's attention.key_length out
    (and builds 128-wide heads), and asks gguf-py for a `mistral` name map it does not have (a
    Mistral file's tensors carry llama's names). Written in float32, the converted weights equal
    the model the file was written from."""
    path, hf_dir = files(family, types=("F32",))
    converted = gguf.converted_dir(path, tmp_path, "float32")
    ours = _state(AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32))
    original = _state(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32))
    assert set(ours) == set(original)
    for name in ours:
        assert torch.equal(ours[name], original[name]), name


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_engine_greedy_tokens_on_a_gguf_equal_transformers_on_the_same_file(files, family):
    path, _ = files(family)
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    want = []
    for ids in PROMPTS:
        out = theirs.generate(torch.tensor([ids]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                              min_new_tokens=GREEDY.max_tokens)
        want.append(out[0, len(ids):].tolist())
    for mode in ("static", "continuous"):
        llm = LLMEngine(EngineConfig(model=str(path), scheduling=mode, max_batch_tokens=2048))
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want, mode


def test_the_tokenizer_and_chat_template_come_from_the_metadata(files, tmp_path):
    path, hf_dir = files("llama")
    converted = gguf.converted_dir(path, tmp_path, "float32", weights=False)
    ours = AutoTokenizer.from_pretrained(converted)
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    original = AutoTokenizer.from_pretrained(hf_dir)
    text = "Hello, world! 12345  spaces\n\nnew lines ünïcödé"
    assert ours.encode(text) == theirs.encode(text) == original.encode(text)
    assert ours.chat_template == original.chat_template
    assert (ours.bos_token, ours.eos_token) == (original.bos_token, original.eos_token)


@pytest.mark.parametrize("name", list(gguf.QUANT_TYPES.values()))
def test_every_block_type_dequantizes_as_transformers_independent_dequantizer(name):
    """gguf-py's numpy dequantizer (the converter's) against transformers' torch one, on random
    blocks; Q5_0 and Q5_1, which transformers does not read, round-trip through gguf-py's quantizer."""
    from gguf import GGMLQuantizationType, quants
    from transformers.integrations.gguf.dequant import GGML_BLOCK, dequantize

    kind = GGMLQuantizationType[name]
    values, size = gguf.BLOCKS[kind.value]
    rng = np.random.default_rng(kind.value)
    if kind.value in GGML_BLOCK:
        blocks = rng.integers(0, 256, size=(8, size), dtype=np.uint8)
        for b in blocks:  # finite float16 scales: clear the top exponent bit of every byte pair's high byte
            b[1::2] &= 0x3F
        ours = quants.dequantize(blocks, kind).reshape(-1)
        theirs = dequantize(torch.from_numpy(blocks.reshape(-1).copy()), kind.value).numpy()
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)
    else:
        x = rng.standard_normal((4, values * 2)).astype(np.float32)
        back = quants.dequantize(quants.quantize(x, kind), kind)
        assert np.abs(back - x).max() < 0.1 * np.abs(x).max()


def test_a_second_start_neither_converts_nor_rehashes(files, tmp_path, monkeypatch):
    path, _ = files("llama")
    first = gguf.converted_dir(path, tmp_path, "float32")
    book = tmp_path / "gguf" / "digests.json"
    assert list(json.loads(book.read_text()).values()) == [gguf.file_digest(path, tmp_path / "elsewhere")]
    monkeypatch.setattr(gguf, "_convert", lambda *a: pytest.fail("converted again"))
    assert gguf.converted_dir(path, tmp_path, "float32") == first
    # the digest is remembered against path, size and mtime: a file touched is hashed again
    remembered = json.loads(book.read_text())
    book.write_text(json.dumps({k: "f" * 64 for k in remembered}))
    monkeypatch.undo()
    assert gguf.converted_dir(path, tmp_path, "float32").name.startswith("f" * 16)
    assert gguf.converted_dir(path, tmp_path, "bfloat16") != first  # keyed by the dtype too


def test_a_conversion_killed_midway_leaves_nothing_once_converted_again(files, tmp_path):
    import shutil

    path, _ = files("llama")
    target = gguf.converted_dir(path, tmp_path, "float32")
    shutil.rmtree(target)
    dead = target.parent / f".{target.name}-killed"  # a killed converter's temporary directory
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"\0" * 4096)
    assert gguf.converted_dir(path, tmp_path, "float32") == target
    assert not dead.exists() and not list(target.parent.glob(f".{target.name}-*"))


def test_preflight_reads_the_header_only(files, tmp_path):
    path, _ = files("llama")
    config = EngineConfig(model=str(path), cache_dir=str(tmp_path))
    meta = check_model_files(config)
    assert (meta / "config.json").exists() and (meta / "tokenizer.json").exists()
    assert not (meta / "model.safetensors").exists()
    assert not (tmp_path / "gguf" / "digests.json").exists()  # not hashed either
    assert not [p for p in (tmp_path / "gguf").iterdir() if p.is_dir() and not p.name.startswith("meta-")]


def test_a_gguf_in_a_directory_by_gguf_file_and_a_hub_repo_by_quant_tag(files, tmp_path, hub_model):
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(files("llama", seed=2)[0], repo / "tiny-llama-Q8_0.gguf")
    shutil.copy(files("llama", seed=3)[0], repo / "tiny-llama-Q4_1.gguf")
    with pytest.raises(ModelLoadError, match="holds 2 GGUF files .* name one with engine.gguf_file"):
        resolve_model_dir(EngineConfig(model=str(repo)))
    named = resolve_model_dir(EngineConfig(model=str(repo), gguf_file="tiny-llama-Q8_0.gguf"))
    assert gguf.converted_from(named)["file"] == "tiny-llama-Q8_0.gguf"
    hub_model("testorg/tiny-gguf", repo)
    tagged = resolve_model_dir(EngineConfig(model="testorg/tiny-gguf:Q4_1"))
    assert gguf.converted_from(tagged)["file"] == "tiny-llama-Q4_1.gguf"
    with pytest.raises(ModelLoadError, match="no GGUF files match 'Q6_K'"):
        resolve_model_dir(EngineConfig(model="testorg/tiny-gguf:Q6_K"))


def _cut(path: Path, to: int, tmp_path: Path) -> Path:
    out = tmp_path / f"cut-{to}.gguf"
    out.write_bytes(path.read_bytes()[:to])
    return out


def test_bad_files_are_refused_in_one_line_naming_the_file(files, tmp_path):
    path, _ = files("llama")
    text = tmp_path / "notes.gguf"
    text.write_text("hello, this is not a model\n" * 10)
    size = path.stat().st_size
    cases = [(text, "not a GGUF file"), (_cut(path, 400, tmp_path), "truncated GGUF file"),
             (_cut(path, size - 100, tmp_path), "truncated GGUF file: tensor")]
    for bad, why in cases:
        with pytest.raises(ModelLoadError) as err:
            LLMEngine(EngineConfig(model=str(bad), cache_dir=str(tmp_path)))
        assert why in str(err.value) and bad.name in str(err.value) and "\n" not in str(err.value)


def test_a_missing_tensor_a_misshapen_one_and_no_tokenizer_are_refused(files, tmp_path):
    missing, _ = files("llama", drop=("blk.1.ffn_down.weight",))
    with pytest.raises(ModelLoadError, match=r"missing tensor model\.layers\.1\.mlp\.down_proj\.weight"):
        LLMEngine(EngineConfig(model=str(missing), cache_dir=str(tmp_path)))
    bare, hf_dir = files("llama", tokenizer=False)
    with pytest.raises(ModelLoadError, match="holds no tokenizer; name one with engine.tokenizer"):
        LLMEngine(EngineConfig(model=str(bare), cache_dir=str(tmp_path)))
    llm = LLMEngine(EngineConfig(model=str(bare), tokenizer=str(hf_dir), cache_dir=str(tmp_path)))
    assert len(llm.generate(["hi"], GREEDY)[0].token_ids) == GREEDY.max_tokens
    # a header whose feed_forward_length disagrees with the tensors it holds
    good, _ = files("llama")
    header = gguf.read_header(good)
    header.metadata["llama.feed_forward_length"] = 96
    with pytest.raises(ModelLoadError, match=r"tensor blk\.0\.ffn_\w+\.weight has shape .* config needs"):
        gguf._convert(header, tmp_path / "out", "float32", True)


def test_an_architecture_or_tensor_type_not_read_is_refused(tmp_path):
    import gguf as gguf_py

    writer = gguf_py.GGUFWriter(str(tmp_path / "bloom.gguf"), "bloom")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with pytest.raises(ModelLoadError, match="GGUF architecture 'bloom' is not supported; the engine reads llama"):
        gguf.read_header(tmp_path / "bloom.gguf")
    writer = gguf_py.GGUFWriter(str(tmp_path / "iq.gguf"), "llama")
    raw = np.zeros((8, 18), dtype=np.uint8)  # IQ4_NL's 18-byte blocks of 32
    writer.add_tensor("token_embd.weight", raw, raw_dtype=gguf_py.GGMLQuantizationType.IQ4_NL)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with pytest.raises(ModelLoadError, match=r"tensor token_embd\.weight has ggml type IQ4_NL \(20\), which is not read"):
        gguf.read_header(tmp_path / "iq.gguf")


@pytest.mark.parametrize("alignment, why", [(0, "general.alignment is 0; a GGUF file's alignment is a positive"),
                                             ("32", "general.alignment is '32'"), (48, "48, not a power of two")])
def test_a_bad_alignment_is_refused_in_one_line(tmp_path, alignment, why):
    import gguf as gguf_py

    path = tmp_path / "aligned.gguf"
    writer = gguf_py.GGUFWriter(str(path), "llama")
    if isinstance(alignment, str):
        writer.add_string("general.alignment", alignment)
    else:
        writer.add_uint32("general.alignment", alignment)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with pytest.raises(ModelLoadError) as err:  # a ZeroDivisionError or ValueError traceback before
        gguf.read_header(path)
    assert why in str(err.value) and "\n" not in str(err.value)


def test_quantization_on_load_reads_the_converted_directory(files):
    path, _ = files("llama")
    full = LLMEngine(EngineConfig(model=str(path))).generate(PROMPTS, GREEDY)
    int8 = LLMEngine(EngineConfig(model=str(path), quantization="int8")).generate(PROMPTS, GREEDY)
    assert sum(a.token_ids[0] == b.token_ids[0] for a, b in zip(full, int8)) >= 2
