"""Storage: atomic writes (no partial object ever visible), retries, redaction, short reads."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.io import OutputDir, Shard, Storage, read_shard, redact, redact_spec, source, with_retries

WRITER = """
import os, sys, time
from pipeline.io import Storage
storage = Storage(sys.argv[1], {"endpoint_url": sys.argv[3]} if len(sys.argv) > 3 else {})
data = b"x" * int(sys.argv[2])
real_replace = os.replace
os.replace = lambda *a: (time.sleep(30), real_replace(*a))  # local: die with the bytes written, not renamed
print("writing", flush=True)
storage.write_atomic(storage.path("data", "part-x.parquet"), data)
print("written", flush=True)
"""


def kill_mid_write(url: str, size: int, *extra: str) -> None:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, url, str(size), *extra], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "writing"
    time.sleep(0.3)
    assert proc.poll() is None, "the write finished before it could be interrupted"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def test_a_local_writer_killed_mid_write_leaves_no_part(tmp_path):
    kill_mid_write(str(tmp_path), 64 << 20)
    out = OutputDir(Storage(str(tmp_path)), "parquet")
    assert not (tmp_path / "data" / "part-x.parquet").exists()
    assert [p.name.startswith(".tmp-") for p in (tmp_path / "data").iterdir()] == [True]
    assert out.done_keys() == set()
    assert out.storage.remove_temporaries(out.storage.path("data")) == 1
    assert list((tmp_path / "data").iterdir()) == []


def test_an_s3_writer_killed_mid_upload_leaves_no_object(s3_server):
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server})
    fs.mkdir("upload-kill")
    kill_mid_write("s3://upload-kill/out", 400 << 20, s3_server)
    fs.invalidate_cache()
    assert not fs.exists("upload-kill/out/data/part-x.parquet")
    out = OutputDir(Storage("s3://upload-kill/out", {"endpoint_url": s3_server}), "parquet")
    assert out.done_keys() == set()


def test_retries_transient_errors_then_gives_up_naming_the_operation(monkeypatch):
    monkeypatch.setattr("time.sleep", lambda s: None)
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise OSError("503 SlowDown")
        return "ok"

    assert with_retries(flaky, "reading x") == "ok" and len(calls) == 3
    with pytest.raises(OSError, match="committing y failed after 5 attempts: boom"):
        with_retries(lambda: (_ for _ in ()).throw(OSError("boom")), "committing y")
    with pytest.raises(FileNotFoundError):
        with_retries(lambda: (_ for _ in ()).throw(FileNotFoundError("gone")), "reading z")


class Truncating:
    """A file whose reads return half the bytes asked for: a storage short read."""

    def __init__(self, f):
        self.f = f

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.f.close()

    def __getattr__(self, name):
        return getattr(self.f, name)

    def read(self, n=-1):
        data = self.f.read(n)
        return data[: len(data) // 2] if n is not None and n > 0 else data


def plan(storage: Storage, rows_per_shard: int) -> list[Shard]:
    return list(source.plan_shards(storage, source.list_inputs(storage, "auto"), rows_per_shard))


def test_a_short_read_is_an_error_not_an_empty_shard(tmp_path, monkeypatch):
    (tmp_path / "a.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    storage = Storage(str(tmp_path))
    shard, = plan(storage, 10)
    assert (shard.start, shard.stop, shard.byte_start, shard.byte_stop) == (0, 2, 0, 32)  # the whole file
    real_open = storage.fs.open
    monkeypatch.setattr(storage.fs, "open", lambda *a, **k: Truncating(real_open(*a, **k)))
    with pytest.raises(OSError, match="short read of a.jsonl: 16 of 32 bytes"):
        read_shard(storage, shard)
    monkeypatch.setattr(storage.fs, "open", real_open)
    assert [r.values for r in read_shard(storage, shard)] == [{"prompt": "a"}, {"prompt": "b"}]


def test_a_parquet_short_read_is_a_retried_error_naming_the_file(tmp_path, monkeypatch):
    pq.write_table(pa.table({"prompt": [f"p{i}" for i in range(20)]}), tmp_path / "a.parquet", row_group_size=5)
    storage = Storage(str(tmp_path))
    shards = plan(storage, 8)
    real_open = storage.fs.open
    monkeypatch.setattr(storage.fs, "open", lambda *a, **k: Truncating(real_open(*a, **k)))
    monkeypatch.setattr("time.sleep", lambda s: None)
    with pytest.raises(OSError, match=r"reading a.parquet failed after 5 attempts: cannot read rows 8-16 of a.parquet"):
        with_retries(lambda: read_shard(storage, shards[1]), "reading a.parquet")
    monkeypatch.setattr(storage.fs, "open", real_open)
    assert [r.get("prompt") for r in read_shard(storage, shards[1])] == [f"p{i}" for i in range(8, 16)]


def test_a_parquet_file_shorter_than_planned_loses_no_rows_silently(tmp_path):
    """The file was replaced by a shorter one between planning and reading: the shard that now
    ends early, and the one past the new end, fail with the rows they found."""
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"prompt": [f"p{i}" for i in range(20)]}), path, row_group_size=5)
    storage = Storage(str(tmp_path))
    shards = plan(storage, 8)
    assert [(s.start, s.stop) for s in shards] == [(0, 8), (8, 16), (16, 20)]
    pq.write_table(pa.table({"prompt": [f"p{i}" for i in range(10)]}), path, row_group_size=5)
    assert [r.id for r in read_shard(storage, shards[0])] == [f"a.parquet:{i}" for i in range(8)]
    with pytest.raises(OSError, match="short read of a.parquet: 2 of 8 rows"):
        read_shard(storage, shards[1])
    with pytest.raises(OSError, match="short read of a.parquet: 0 of 4 rows"):
        read_shard(storage, shards[2])


def test_redact_hides_secret_looking_options():
    opts = {"endpoint_url": "http://x", "key": "AKIA", "secret": "s3cr3t", "client_kwargs": {"aws_session_token": "t"},
            "token": None}
    assert redact(opts) == {"endpoint_url": "http://x", "key": "***", "secret": "***",
                            "client_kwargs": {"aws_session_token": "***"}, "token": None}


def test_a_spec_keeps_every_value_but_its_storage_secrets():
    """Only the storage options hold secrets: max_tokens, max_batch_tokens or stop_token_ids are
    recorded as they were set, in _job.json and the manifest."""
    from pipeline.spec import JobSpec

    spec = JobSpec(input={"path": "s3://b/in.jsonl", "storage_options": {"key": "AKIA", "endpoint_url": "http://x"}},
                   output={"path": "s3://b/out", "storage_options": {"secret": "s3cr3t"}},
                   sampling={"max_tokens": 7, "stop_token_ids": [2]}, engine={"max_batch_tokens": 4096})
    shown = redact_spec(spec.model_dump(mode="json"))
    assert shown["input"]["storage_options"] == {"key": "***", "endpoint_url": "http://x"}
    assert shown["output"]["storage_options"] == {"secret": "***"}
    assert shown["sampling"]["max_tokens"] == 7 and shown["sampling"]["stop_token_ids"] == [2]
    assert shown["engine"]["max_batch_tokens"] == 4096
    assert spec.input.storage_options["key"] == "AKIA"  # the spec itself is untouched
