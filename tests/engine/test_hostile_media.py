"""Hostile images and model files, second round (each class against a real server on loopback):
every redirect of an image download is held to allowed_media_domains and the whole download to a
deadline; s3:// images are read only under engine.allowed_media_buckets (moto); only the image
formats the engine reads are opened and any decoding failure fails its row; a thin image is refused
before a processor blows it up; a row's failure of any kind leaves the engine clean; an object key
that would land outside the model cache is refused, and two processes copying one model get one
whole copy."""
from __future__ import annotations

import hashlib
import http.server
import io
import multiprocessing
import threading
import time
from pathlib import Path

import pytest
from PIL import Image

from engine import EngineConfig, LLMEngine, ModelLoadError, SamplingParams
from engine.models.files import copy_remote
from engine.multimodal import MediaPolicy, load_image
from engine.multimodal import media
from vlm_models import build_llava, images, png_bytes

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPT = "USER: <image>\nDescribe it. ASSISTANT:"


@pytest.fixture(scope="module")
def web():
    """An HTTP server on 127.0.0.1 that serves an image, redirects (to itself, to another host's
    name, to ftp://, in a loop) and drips a body a byte at a time."""
    picture = png_bytes(images()[0])
    asked: dict[str, int] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            port = self.server.server_address[1]
            asked[self.path] = asked.get(self.path, 0) + 1
            if self.path == "/down" or (self.path == "/flaky" and asked[self.path] == 1):
                self.send_response(503)  # overloaded: down for good, or for the first request only
                self.end_headers()
                return
            if self.path == "/flaky":
                self.path = "/ok.png"
            routes = {"/in": f"http://127.0.0.1:{port}/ok.png", "/out": f"http://localhost:{port}/ok.png",
                      "/ftp": "ftp://127.0.0.1/ok.png", "/loop": "/loop", "/relative": "/ok.png"}
            if self.path in routes:
                self.send_response(302)
                self.send_header("Location", routes[self.path])
                self.end_headers()
            elif self.path == "/ok.png":
                self.send_response(200)
                self.send_header("Content-Length", str(len(picture)))
                self.end_headers()
                self.wfile.write(picture)
            elif self.path == "/drip":
                self.send_response(200)
                self.send_header("Content-Length", str(len(picture)))
                self.end_headers()
                try:
                    for i in range(len(picture)):
                        self.wfile.write(picture[i:i + 1])
                        self.wfile.flush()
                        time.sleep(0.05)
                except OSError:
                    pass  # the client gave up, as it should
            else:
                self.send_response(404)
                self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


ALLOWED = MediaPolicy(allowed_media_domains=("127.0.0.1",))


def test_a_redirect_is_followed_only_to_an_allowed_host_and_scheme(web):
    assert load_image(f"{web}/in", ALLOWED).size == (64, 48)
    assert load_image(f"{web}/relative", ALLOWED).size == (64, 48)
    for path, fragment in {"/out": "redirects to http://localhost:", "/ftp": "scheme 'ftp' is not http(s)",
                           "/loop": "redirects more than 5 times"}.items():
        with pytest.raises(ValueError) as refused:
            load_image(f"{web}{path}", ALLOWED)
        assert fragment in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
    with pytest.raises(ValueError, match="host 'localhost' is not in engine.allowed_media_domains \\(127.0.0.1\\)"):
        load_image(f"{web}/out", ALLOWED)


def test_a_failure_that_may_pass_is_tried_again_before_it_is_the_rows(web):
    assert load_image(f"{web}/flaky", ALLOWED).size == (64, 48)  # a 503, then the image
    with pytest.raises(ValueError, match=r"/down cannot be read \(3 attempts\): HTTP 503$"):
        load_image(f"{web}/down", ALLOWED)
    with pytest.raises(ValueError, match=r"/missing cannot be read: HTTP 404$"):  # not tried again
        load_image(f"{web}/missing", ALLOWED)


def test_a_dripping_server_is_cut_off_at_the_deadline(web, monkeypatch):
    monkeypatch.setattr(media, "DOWNLOAD_TIMEOUT_S", 0.5)
    started = time.monotonic()
    with pytest.raises(ValueError, match="was not read within 0.5 s"):
        load_image(f"{web}/drip", ALLOWED)
    assert time.monotonic() - started < 2.0  # the whole download's deadline, not one per read


@pytest.fixture(scope="module")
def media_bucket(s3_server):
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server})
    fs.mkdir("media")
    for key in ("allowed/ok.png", "allowed-not/ok.png", "secret/ok.png"):
        fs.pipe(f"media/{key}", png_bytes(images()[0]))
    return fs


def test_object_storage_images_are_read_only_under_an_allowed_bucket_or_prefix(media_bucket):
    with pytest.raises(ValueError, match="s3://media/secret/ok.png is not under engine.allowed_media_buckets, "
                                         "which is empty"):
        load_image("s3://media/secret/ok.png", MediaPolicy())
    prefix = MediaPolicy(allowed_media_buckets=("s3://media/allowed",))
    assert load_image("s3://media/allowed/ok.png", prefix).size == (64, 48)
    for url in ("s3://media/allowed-not/ok.png", "s3://media/secret/ok.png", "gs://media/allowed/ok.png"):
        with pytest.raises(ValueError, match=r"is not under engine.allowed_media_buckets \(s3://media/allowed\)"):
            load_image(url, prefix)
    assert load_image("s3://media/secret/ok.png", MediaPolicy(allowed_media_buckets=("media",))).size == (64, 48)


def image_bytes(fmt: str, size=(4, 4)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(buffer, fmt)
    return buffer.getvalue()


def test_only_the_formats_read_are_opened_and_any_decoding_failure_is_the_rows(monkeypatch):
    for fmt in ("DDS", "ICO", "TGA", "PPM"):  # formats Pillow half-supports or that no model needs
        with pytest.raises(ValueError, match=r"is not an image in a format images are read in \(PNG, JPEG, WEBP"):
            load_image(image_bytes(fmt), MediaPolicy())
    for fmt in ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"):
        assert load_image(image_bytes(fmt), MediaPolicy()).size == (4, 4)

    def unsupported(self):
        raise NotImplementedError("Unimplemented pixel format")

    png = image_bytes("PNG")
    monkeypatch.setattr(Image.Image, "load", unsupported)
    with pytest.raises(ValueError, match="^the image's bytes does not decode: NotImplementedError: Unimplemented "
                                         "pixel format$"):
        load_image(png, MediaPolicy())


def test_a_thin_image_is_refused_from_its_header_naming_the_bound():
    with pytest.raises(ValueError, match=r"is 1x400, an aspect ratio of 400, over engine.max_image_aspect_ratio "
                                         r"\(200\)"):
        load_image(image_bytes("PNG", (1, 400)), MediaPolicy())
    assert load_image(image_bytes("PNG", (1, 400)), MediaPolicy(max_image_aspect_ratio=500)).size == (1, 400)
    assert load_image(image_bytes("PNG", (2, 400)), MediaPolicy()).size == (2, 400)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return str(build_llava(tmp_path_factory.mktemp("llava")))


def test_no_row_of_any_kind_leaves_the_engine_busy(llava, monkeypatch):
    llm = LLMEngine(EngineConfig(model=llava, dtype="float32", device="cpu", max_num_seqs=8, block_size=8))
    good = {"prompt": PROMPT, "multi_modal_data": {"image": images()[0]}}
    clean = llm.generate([good], GREEDY)[0]
    assert clean.error is None
    rows = [good, {"prompt": PROMPT, "multi_modal_data": {"image": image_bytes("DDS")}},
            {"prompt": PROMPT, "multi_modal_data": {"image": image_bytes("PNG", (1, 400))}}, good]
    outs = llm.generate(rows, GREEDY)
    assert [o.error is None for o in outs] == [True, False, False, True]
    assert outs[0].token_ids == outs[3].token_ids == clean.token_ids
    assert "over engine.max_image_aspect_ratio" in outs[2].error and "\n" not in outs[1].error

    processor = llm.images.processor
    calls = []

    def exploding(*args, **kwargs):  # the processor of one row runs out of memory, another's breaks oddly
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError()
        if len(calls) == 3:
            raise RuntimeError("the processor's own bug\nwith a traceback's second line")
        return processor(*args, **kwargs)

    monkeypatch.setattr(llm.images, "processor", exploding)
    outs = llm.generate([good, good, good, good], GREEDY)
    assert outs[1].error.startswith("the processor ran out of memory on this prompt's 1 image(s) (64x48)")
    assert outs[2].error == "the processor refused the prompt: RuntimeError: the processor's own bug"
    assert outs[0].token_ids == outs[3].token_ids == clean.token_ids

    monkeypatch.undo()
    original, seen = llm.images.prepare, []

    class Stop(BaseException):
        """Not a row's fault (Ctrl-C, say): the call fails, and leaves nothing of its rows behind."""

    def stopping(*args, **kwargs):
        seen.append(1)
        if len(seen) == 3:
            raise Stop
        return original(*args, **kwargs)

    monkeypatch.setattr(llm.images, "prepare", stopping)
    with pytest.raises(Stop):
        llm.generate([good, good, good, good], GREEDY)
    assert not llm.has_unfinished()
    monkeypatch.undo()
    assert llm.generate([good], GREEDY)[0].token_ids == clean.token_ids


@pytest.fixture()
def model_bucket(s3_server, tiny_model_dir):
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server})
    name = f"models-{time.monotonic_ns()}"
    fs.mkdir(name)
    src = tiny_model_dir("llama")
    for f in src.iterdir():
        fs.put_file(str(f), f"{name}/llm/{f.name}")
    return fs, name, src


def test_an_object_key_that_leads_outside_the_cache_is_refused(model_bucket, tmp_path):
    fs, bucket, _ = model_bucket
    fs.pipe(f"{bucket}/llm/../../../../escape/planted.pth", b"import os  # planted")
    cache = tmp_path / "deep" / "cache"
    with pytest.raises(ModelLoadError, match=r"the object '.*llm/\.\./\.\./\.\./\.\./escape/planted\.pth' would be "
                                             r"copied outside the cache"):
        copy_remote(f"s3://{bucket}/llm", cache)
    assert not list(tmp_path.rglob("planted.pth")) and not (tmp_path / "escape").exists()
    assert not [p for p in (cache / "models").iterdir() if not p.name.startswith(".")]  # nothing half-copied


def _copy(url: str, cache: str, endpoint: str, start: float, out) -> None:
    import os

    os.environ["AWS_ENDPOINT_URL"] = endpoint
    time.sleep(max(0.0, start - time.time()))
    try:
        out.put(str(copy_remote(url, Path(cache))))
    except Exception as exc:  # noqa: BLE001  reported to the test
        out.put(f"error: {exc}")


def digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in directory.iterdir() if p.name != ".complete"}


def test_two_processes_copying_one_model_get_one_whole_copy(model_bucket, s3_server, tmp_path):
    fs, bucket, src = model_bucket
    big = bytes(range(256)) * (4 * 2**20 // 256)  # 4 MiB, so that the copies overlap
    fs.pipe(f"{bucket}/llm/extra.bin", big)
    (tmp_path / "expected").mkdir()
    for f in src.iterdir():
        (tmp_path / "expected" / f.name).write_bytes(f.read_bytes())
    (tmp_path / "expected" / "extra.bin").write_bytes(big)
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    start = time.time() + 3.0
    procs = [context.Process(target=_copy, args=(f"s3://{bucket}/llm", str(tmp_path / "cache"), s3_server, start, out))
             for _ in range(2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert results[0] == results[1] and not results[0].startswith("error"), results
    assert digests(Path(results[0])) == digests(tmp_path / "expected")
    leftovers = [p.name for p in (tmp_path / "cache" / "models").iterdir() if not p.name.endswith(".lock")]
    assert leftovers == [Path(results[0]).name]  # no temporary copy left behind


def test_a_copy_whose_objects_changed_under_the_same_url_is_copied_anew(model_bucket, tmp_path):
    from engine import EngineConfig
    from engine.models import model_identity

    fs, bucket, _ = model_bucket
    url, cache = f"s3://{bucket}/llm", tmp_path / "cache"
    identity = model_identity(EngineConfig(model=url))
    copy = copy_remote(url, cache)
    fs.pipe(f"{bucket}/llm/generation_config.json", b'{"note": "rewritten"}')
    assert model_identity(EngineConfig(model=url)) != identity  # the listing changed: sizes and ETags
    assert copy_remote(url, cache) == copy
    assert (copy / "generation_config.json").read_bytes() == b'{"note": "rewritten"}'
