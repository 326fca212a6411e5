"""Security defaults: secrets stay out of everything a job writes or prints; paths stay inside
the output prefix; templates reach nothing but column values; unsafe loading is opt-in."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from helpers import write_jsonl
from jobs.cli import main
from pipeline.errors import TemplateError
from pipeline.io import OutputDir, Shard, Storage
from pipeline.tasks import PromptBuilder

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYSECRET"


def everything_written(root) -> str:
    return "\n".join(p.read_text(errors="replace") for p in root.rglob("*") if p.is_file()
                     and not p.name.endswith(".parquet"))


@pytest.mark.usefixtures("ray_local")
def test_secrets_never_reach_logs_manifest_errors_or_help(tmp_path, s3_server, monkeypatch):
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server})
    fs.mkdir("secret-test")
    fs.pipe("secret-test/in.jsonl", b'{"prompt": "hello"}\n{"prompt": null}\n')
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)  # what the driver holds, as on a real host
    opts = f"{{key: testing, secret: {SECRET}, endpoint_url: '{s3_server}'}}"
    args = ["run", "--model", "builtin:echo", "--input", "s3://secret-test/in.jsonl", "--output", "s3://secret-test/out/",
            "--set", f"input.storage_options={opts}", "--set", f"output.storage_options={opts}",
            "--set", "sampling.max_tokens=2"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 3  # the null prompt exceeds max_error_rate 0: the failure path prints too
    assert SECRET not in result.output
    written = {p: fs.cat(p).decode(errors="replace") for p in fs.find("secret-test/out")
               if not p.endswith(".parquet")}
    assert written and not [p for p, text in written.items() if SECRET in text]
    assert "***" in fs.cat("secret-test/out/manifest.json").decode()
    failed = CliRunner().invoke(main, ["run", "--model", "builtin:echo", "--input", "s3://no-such-bucket-x/in.jsonl", "--output",
                                       str(tmp_path / "o"), "--set", f"input.storage_options={opts}"])
    assert failed.exit_code == 1 and "error:" in failed.output and SECRET not in failed.output
    for command in (["--help"], ["run", "--help"], ["spec"]):
        assert SECRET not in CliRunner().invoke(main, command).output


def test_part_paths_stay_inside_the_output_prefix(tmp_path):
    out = OutputDir(Storage(str(tmp_path / "out")), "parquet")
    for name in ("../../etc/passwd.jsonl", "/abs/../../x.parquet", "a/../../../b.jsonl"):
        shard = Shard(file=name, name=name, format="jsonl", start=0, stop=5)
        path = out.part_path(shard.key)
        assert path.startswith(str(tmp_path / "out" / "data") + "/") and ".." not in path
        assert out.progress_path(shard.key).startswith(str(tmp_path / "out" / "_progress") + "/")


@pytest.mark.parametrize("template", ["{prompt.__class__.__init__.__globals__}", "{prompt.__dict__}",
                                      "{prompt[0]}", "{0.__class__}", "{prompt!r:{x}}"])
def test_hostile_templates_are_refused_before_any_row(template):
    with pytest.raises(TemplateError):
        PromptBuilder(template=template)


def test_templates_see_column_values_only(tmp_path):
    builder = PromptBuilder(template="{__builtins__} {open}")
    assert builder.build({"prompt": "x"}) == (None, "template refers to missing column '__builtins__'")
    assert builder.build({"__builtins__": "a", "open": "b"}) == ("a b", None)
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP SECRET")
    prompt, _ = PromptBuilder(template="{path}").build({"path": str(secret)})
    assert "TOP SECRET" not in prompt


@pytest.mark.usefixtures("ray_local")
def test_unsafe_loading_is_off_and_visible_in_the_manifest(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}])
    result = CliRunner().invoke(main, ["run", "--model", "builtin:tiny", "--input", str(tmp_path / "in.jsonl"), "--output",
                                       str(tmp_path / "out"), "--set", "sampling.max_tokens=2"])
    assert result.exit_code == 0, result.output
    engine = json.loads((tmp_path / "out" / "manifest.json").read_text())["spec"]["engine"]
    assert engine["allow_pickle"] is False and engine["trust_remote_code"] is False
