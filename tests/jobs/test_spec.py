"""The job spec: one validation, paths of bad keys, --set overrides, one default per field."""
import dataclasses

import pytest
from click.testing import CliRunner

from engine import EngineConfig, SamplingParams
from jobs.cli import main
from jobs.spec import SpecError, field_reference, load_spec, validate


def spec(*overrides, **kw):
    return load_spec(None, list(overrides), input=kw.get("input", "in.jsonl"), output=kw.get("output", "out/"))


def test_defaults_come_from_the_engine_dataclasses():
    s = spec()
    for name in s.sampling.model_fields:
        assert getattr(s.sampling, name) == getattr(SamplingParams(), name)
    assert set(s.sampling.model_fields) == {f.name for f in dataclasses.fields(SamplingParams)}
    for name in s.engine.model_fields:
        assert getattr(s.engine, name) == getattr(EngineConfig(), name)
    assert s.model == "builtin:smollm2-135m-instruct" and s.workers.cpus < 1


@pytest.mark.parametrize("override,message", [
    ("engine.max_batch_tokenz=3", "engine.max_batch_tokenz: unknown key"),
    ("workers.num=many", "workers.num: Input should be a valid integer"),
    ("sampling.temperature=-1", "sampling.temperature: temperature must be >= 0.0"),
    ("sampling.top_p=2", "sampling.top_p"),
    ("sampling.max_tokens=0", "sampling.max_tokens: max_tokens must be >= 1"),
    ("sampling.max_tokens=-5", "sampling.max_tokens"),
    ("max_error_rate=1.5", "max_error_rate"),
    ("output.format=csv", "output.format"),
    ("bogus=1", "bogus: unknown key"),
])
def test_bad_values_name_their_path(override, message):
    with pytest.raises(SpecError, match="invalid job spec") as err:
        spec(override)
    assert message in str(err.value)


def test_set_parses_yaml_values_and_nested_keys(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("model: builtin:tiny\ninput: {path: a.jsonl}\noutput: {path: out/}\n"
                    "sampling: {max_tokens: 8}\n")
    s = load_spec(path, ['sampling.stop=["\\n", "###"]', "engine.max_model_len=null", "workers.gpus=0.5"],
                  output="elsewhere/")
    assert s.sampling.stop == ["\n", "###"] and s.sampling.max_tokens == 8
    assert s.engine.max_model_len is None and s.workers.gpus == 0.5
    assert s.output.path == "elsewhere/"


def test_missing_paths_and_bad_files(tmp_path):
    with pytest.raises(SpecError, match="input: required"):
        load_spec(None, [], output="o")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(bad)
    with pytest.raises(SpecError, match="cannot read spec"):
        load_spec(tmp_path / "missing.yaml")


def test_fingerprint_tracks_what_changes_rows():
    base = spec().fingerprint()
    assert spec(output="other/").fingerprint() == base
    assert spec("workers.num=4").fingerprint() == base
    assert spec("sampling.max_tokens=99").fingerprint() != base
    # shard boundaries never change a row, and an output keeps the plan it started with
    assert spec("workers.rows_per_batch=7").fingerprint() == base == spec("workers.shard_bytes=4096").fingerprint()


@pytest.mark.parametrize("overrides,message", [
    (["sampling.n=0"], "sampling.n: n must be >= 1, got 0"),
    (["sampling.n=129"], "sampling.n: n must be <= 128, got 129"),
    (["sampling.n=two"], "sampling.n: Input should be a valid integer"),
    (["sampling.n=2", "task=label", "label.choices=[a, b]"], "sampling.n: choice scoring"),
    (["sampling.n=3", "task=eval", "eval.reference_column=a", "eval.k=[1, 4]"],
     "eval.k: each k must be in [1, sampling.n=3], got 4"),
    (["sampling.n=3", "task=eval", "eval.reference_column=a", "eval.k=[0]"], "eval.k: each k must be in"),
    (["sampling.n=3", "task=eval", "eval.reference_column=a", "eval.k=[]"], "eval.k: give at least one k"),
    (["sampling.n=3", "task=eval", "eval.reference_column=a", "eval.k=[2, 2]"], "eval.k lists a k twice"),
    (["eval.k=[2]"], "eval.k: each k must be in [1, sampling.n=1], got 2"),
    (["sampling.n=2", "task=eval", "eval.reference_column=sample_index"], "eval.reference_column: 'sample_index' is "
     "also an output column"),
])
def test_bad_sample_settings_are_one_line_naming_the_key(overrides, message):
    with pytest.raises(SpecError) as err:
        spec(*overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_n_counts_in_the_fingerprint_only_above_one_and_eval_k_never():
    base = spec().fingerprint()
    assert spec("sampling.n=1").fingerprint() == base  # outputs written before n existed still resume
    assert spec("sampling.n=2").fingerprint() != base
    assert spec("sampling.n=4", "eval.k=[2]").fingerprint() == spec("sampling.n=4").fingerprint()
    assert spec("sampling.n=2").sampling.n == 2 and spec().eval.k is None


def test_every_field_has_a_description_and_the_cli_lists_them():
    rows = field_reference()
    assert all(desc for _, _, _, desc in rows)
    out = CliRunner().invoke(main, ["spec"])
    assert out.exit_code == 0
    for key, *_ in rows:
        assert key in out.output


def test_cli_rejects_a_bad_spec_with_exit_code_2(tmp_path):
    out = CliRunner().invoke(main, ["run", "--input", "x.jsonl", "--output", str(tmp_path), "--set", "nope=1"])
    assert out.exit_code == 2 and "nope: unknown key" in out.output


PLANNED = "25dfd50d5dd2eea4"
"""The fingerprint of the 0.1 spec below since its shard settings count as at their defaults."""


def test_fingerprint_of_a_spec_written_before_the_task_fields_is_unchanged():
    """Outputs started by batchinfer 0.1 (before label/eval/chat/prefill/shard_bytes fields existed)
    resume: fields added since count only when set. The value was computed by the 0.1 code
    (ac30e8b). 0.1 cut shards every 256 rows by default; shards are now cut by bytes, so such an
    output resumes with that row count set (tests/jobs/test_layout.py: the refusal says so), or through
    the spec it recorded. Since 2026-12-04 the shard settings count as at their defaults: the value
    is among those accepted."""
    spec = {"model": "builtin:tiny", "input": {"path": "in.jsonl", "template": "{q}"}, "output": {"path": "o"}, "sampling": {"max_tokens": 5},
            "workers": {"rows_per_batch": 256}}
    assert "aaf815c29dd0473d" in validate(spec).accepted_fingerprints()
    assert "aaf815c29dd0473d" not in validate({**spec, "workers": {}}).accepted_fingerprints()
    assert validate(spec).fingerprint() == validate({**spec, "workers": {}}).fingerprint() == PLANNED


def test_fields_that_never_change_a_row_count_no_more_and_outputs_that_counted_them_resume():
    """max_prefill_tokens (the deprecated alias of max_num_batched_tokens), prefix_cache_tokens
    (ignored), cache_dir and allow_pickle never change a row: they count as at their defaults.
    An output whose fingerprint counted them resumes: the values are those the previous version
    computed (2026-12-01), and renaming max_prefill_tokens as its warning says keeps the output."""
    spec = {"model": "builtin:tiny", "input": {"path": "in.jsonl", "template": "{q}"}, "output": {"path": "o"}, "sampling": {"max_tokens": 5},
            "workers": {"rows_per_batch": 256}}
    earlier = {"d4a74a0721547478": {"max_prefill_tokens": 512}, "6595b856724a8335": {"cache_dir": "/tmp/hf",
               "allow_pickle": True}, "5b9c99d902374a4e": {"prefix_cache_tokens": 4096}}
    with pytest.warns(DeprecationWarning):
        for value, engine in earlier.items():
            job = validate({**spec, "engine": engine})
            assert job.fingerprint() == PLANNED and value in job.accepted_fingerprints()
    renamed = validate({**spec, "engine": {"max_num_batched_tokens": 512}})
    assert "d4a74a0721547478" in renamed.accepted_fingerprints()
    assert "d4a74a0721547478" not in validate({**spec, "engine": {"max_num_batched_tokens": 256}}).accepted_fingerprints()


BLOCKED = """
import sys
from pathlib import Path

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError(f"{name} is blocked in this test")

sys.meta_path.insert(0, Block())
from jobs.spec import load_spec
from pipeline.spec import validate

configs = sorted(Path("configs").glob("*.yaml"))
for path in configs:
    spec = load_spec(path)
    spec.engine_config()
    spec.fingerprint()
validate({"task": "label", "label": {"choices": ["yes", "no"]}, "input": {"path": "-"}, "output": {"path": "-"}})
assert "torch" not in sys.modules and "transformers" not in sys.modules
print(len(configs), "ok")
"""


def test_every_config_validates_with_torch_and_transformers_blocked():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", BLOCKED], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == [str(len(list((root / "configs").glob("*.yaml")))), "ok"], \
        out.stderr[-3000:]


def test_tensor_parallel_gpus_default_to_one_per_rank_on_cuda():
    assert spec("engine.tensor_parallel_size=2", "engine.device=cuda").workers.gpus == 2
    assert spec("engine.tensor_parallel_size=2", "workers.gpus=2").workers.gpus == 2
    assert spec("engine.tensor_parallel_size=2").workers.gpus == 0  # on CPU the ranks share the actor's cores
    assert spec("engine.tensor_parallel_size=2", "engine.device=cuda", "workers.gpus=0").workers.gpus == 0


@pytest.mark.parametrize("gpus", ["1", "0.5", "4"])
def test_tensor_parallel_gpus_other_than_one_per_rank_are_refused_in_one_line(gpus):
    with pytest.raises(SpecError) as err:
        spec("engine.tensor_parallel_size=2", f"workers.gpus={gpus}")
    assert str(err.value) == (f"invalid job spec: workers.gpus {float(gpus):g} with engine.tensor_parallel_size 2: "
                              "an actor needs one GPU per rank; set workers.gpus: 2 (or 0 to run the ranks on CPU), "
                              "or leave it unset with engine.device: cuda")


def test_tensor_parallel_settings_change_the_fingerprint_only_when_quantized():
    base = spec().fingerprint()
    assert spec("engine.tensor_parallel_size=2", "engine.distributed_timeout_s=30").fingerprint() == base
    # each rank quantizes its own shard, with its own scales: 1 and 2 ranks give other rows
    int8 = spec("engine.quantization=int8").fingerprint()
    assert spec("engine.quantization=int8", "engine.tensor_parallel_size=1").fingerprint() == int8 != base
    assert spec("engine.quantization=int8", "engine.tensor_parallel_size=2").fingerprint() != int8
    with pytest.raises(SpecError, match="engine.tensor_parallel_size: tensor_parallel_size must be a positive"):
        spec("engine.tensor_parallel_size=0")
