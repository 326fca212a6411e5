"""Hugging Face model ids: resolved offline from a cache in the hub's own layout, one-line errors
naming the id, only the files loading needs, one download at a time per repository."""
from __future__ import annotations

import http.server
import os
import shutil
import threading
import time

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.models import hub
from engine.models.builtin import builtin_path
from engine import ModelLoadError
from engine.models.files import check_model_files, resolve_model_dir

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_hub_id_loads_offline_from_the_cache(hub_model):
    from huggingface_hub import scan_cache_dir

    commit = hub_model("testorg/tiny-chat", builtin_path("builtin:tiny"))
    repos = {r.repo_id: r for r in scan_cache_dir(os.environ["HF_HUB_CACHE"]).repos}
    assert {rev.commit_hash for rev in repos["testorg/tiny-chat"].revisions} == {commit}  # the hub's own layout
    llm = LLMEngine(EngineConfig(model="testorg/tiny-chat"))
    builtin = LLMEngine(EngineConfig(model="builtin:tiny"))
    assert llm.generate(["hello"], GREEDY)[0].token_ids == builtin.generate(["hello"], GREEDY)[0].token_ids


def test_revision_picks_a_branch_or_a_commit(hub_model, tiny_model_dir):
    main = hub_model("testorg/two-revs", builtin_path("builtin:tiny"))
    other = hub_model("testorg/two-revs", tiny_model_dir("qwen2"), revision="v2")
    assert resolve_model_dir(EngineConfig(model="testorg/two-revs")).name == main
    assert resolve_model_dir(EngineConfig(model="testorg/two-revs", revision="v2")).name == other
    assert resolve_model_dir(EngineConfig(model="testorg/two-revs", revision=other)).name == other
    with pytest.raises(ModelLoadError, match="testorg/two-revs at revision 'v3' is not in the cache"):
        resolve_model_dir(EngineConfig(model="testorg/two-revs", revision="v3"))


def test_missing_id_offline_is_one_line_naming_it():
    with pytest.raises(ModelLoadError) as info:
        LLMEngine(EngineConfig(model="nobody/no-such-model"))
    message = str(info.value)
    assert "nobody/no-such-model" in message and "HF_HUB_OFFLINE" in message and "\n" not in message


def test_an_existing_local_directory_wins_over_a_hub_id(hub_model, tiny_model_dir, tmp_path, monkeypatch):
    hub_model("testorg/shadowed", builtin_path("builtin:tiny"))
    shutil.copytree(tiny_model_dir("gpt2"), tmp_path / "testorg" / "shadowed")
    monkeypatch.chdir(tmp_path)
    assert resolve_model_dir(EngineConfig(model="testorg/shadowed")).resolve() == tmp_path / "testorg" / "shadowed"
    with pytest.raises(ModelLoadError, match="model directory not found: ./testorg/nothing"):
        resolve_model_dir(EngineConfig(model="./testorg/nothing"))  # a path, not an id


def test_pickle_only_repo_needs_allow_pickle(hub_model, tiny_model_dir, tmp_path):
    import torch
    from safetensors.torch import load_file

    src = tmp_path / "pickled"
    shutil.copytree(tiny_model_dir("llama"), src)
    torch.save(load_file(src / "model.safetensors"), src / "pytorch_model.bin")
    (src / "model.safetensors").unlink()
    hub_model("testorg/pickled", src)
    with pytest.raises(ModelLoadError, match="allow_pickle"):
        check_model_files(EngineConfig(model="testorg/pickled"))
    assert check_model_files(EngineConfig(model="testorg/pickled", allow_pickle=True)).is_dir()


def test_is_hub_id_shape():
    assert hub.is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and hub.is_hub_id("meta-llama/Llama-3.1-8B")
    for ref in ("gpt2", "/abs/path", "a/b/c", "org/../x", "org--x/y", "./org/x", "org/"):
        assert not hub.is_hub_id(ref), ref


# -- online: a stand-in Hub on loopback answers like huggingface.co does for missing and gated repos --

class _FakeHub(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        code = "GatedRepo" if "gated" in self.path else "RepoNotFound"
        self.send_response(401 if code == "GatedRepo" else 404)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "no"}')

    do_HEAD = do_GET  # noqa: N815

    def log_message(self, *args):
        pass


@pytest.fixture
def online_hub(monkeypatch, tmp_path):
    import huggingface_hub.constants

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # read when it was imported
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-token"))
    yield server
    server.shutdown()


def test_missing_and_gated_ids_online_say_what_to_do(online_hub):
    with pytest.raises(ModelLoadError) as info:
        check_model_files(EngineConfig(model="nobody/missing"))
    assert str(info.value) == "Hugging Face model nobody/missing not found on the Hub (or private, and no HF_TOKEN is set)"
    with pytest.raises(ModelLoadError, match="nobody/gated-model is gated: accept its terms.*no HF_TOKEN is set"):
        check_model_files(EngineConfig(model="nobody/gated-model"))
    assert (hub.cache_dir() / ".locks").is_dir()  # HF_HUB_CACHE read at the call, not at import


def test_one_download_per_repository_at_a_time(online_hub):
    from filelock import FileLock

    lock = FileLock(str(hub.cache_dir() / ".locks" / "models--nobody--busy" / "batchinfer-snapshot.lock"))
    lock.acquire()
    errors = []
    thread = threading.Thread(target=lambda: errors.append(_resolve_error("nobody/busy")))
    thread.start()
    time.sleep(1.0)
    assert thread.is_alive() and not errors  # waits for the other download
    lock.release()
    thread.join(30)
    assert errors and "nobody/busy not found" in errors[0]


def _resolve_error(repo_id: str) -> str:
    try:
        hub.resolve(repo_id)
    except ModelLoadError as exc:
        return str(exc)
    return ""


def test_an_unwritable_cache_online_is_one_line(online_hub, tmp_path, monkeypatch):
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "not-a-dir"))
    with pytest.raises(ModelLoadError, match="cannot write to the Hugging Face cache .* to fetch nobody/x .*HF_HUB_OFFLINE"):
        hub.resolve("nobody/x")
