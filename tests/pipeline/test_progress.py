"""Progress reporters: plain lines off a terminal, a bar with rows, tokens/s and ETA on one."""
from __future__ import annotations

import io

from pipeline.io import RunRecord
from pipeline.run import Progress, ProgressBar, as_progress


def counts(rows, tokens, errors=0):
    return RunRecord(run_id="run", started=0.0, last_seen=0.0, rows=rows, errors=errors, generated_tokens=tokens)


def test_plain_lines_one_per_shard():
    lines = []
    progress = Progress(lines.append)
    progress("3 shards planned")
    progress.start(shards=3, rows=30)
    progress.shard_done(counts(10, 50), 10)
    progress.shard_done(counts(20, 100, errors=1), 10)
    progress.close()
    assert lines[0] == "3 shards planned"
    assert lines[1].startswith("[1/3 shards] 10 rows, 0 errors, 50 tokens, ") and lines[1].endswith(" tok/s")
    assert lines[2].startswith("[2/3 shards] 20 rows, 1 errors, 100 tokens, ")


def test_bar_shows_rows_tokens_per_second_and_eta_and_keeps_messages_above_it():
    stream = io.StringIO()
    bar = ProgressBar(stream, lambda msg: stream.write(msg + "\n"))
    bar.start(shards=4, rows=40)
    bar.shard_done(counts(10, 80), 10)
    bar("a message while the bar runs")
    bar.shard_done(counts(20, 160, errors=2), 10)
    bar.close()
    text = stream.getvalue()
    last = text.replace("\r", "\n").strip().splitlines()[-1]
    assert "generating:" in last and "20/40 rows" in last and "<" in last  # elapsed<remaining (ETA)
    assert "tok/s, 2 errors, 2/4 shards" in last and "row/s" in last
    assert "a message while the bar runs\n" in text


def test_a_plain_callable_still_works():
    lines = []
    as_progress(lines.append)("hello")
    assert lines == ["hello"]


def test_a_streamed_plan_reports_share_of_input_and_eta_from_bytes(monkeypatch):
    import pipeline.run.reporting.progress as mod

    now = [1000.0]
    monkeypatch.setattr(mod.time, "time", lambda: now[0])
    lines = []
    progress = Progress(lines.append)
    progress.start(None, None, total_bytes=1000)
    progress.shard_done(counts(0, 0), 0, earlier=1, nbytes=200, new=False)  # committed by an earlier run
    assert lines[-1].endswith(", 20% of input")  # no rate of this run yet: no ETA
    now[0] += 10
    progress.shard_done(counts(10, 50), 10, earlier=1, nbytes=200)
    # 200 new bytes in 10 s; 600 bytes left -> 30 s
    assert lines[-1].startswith("[2 shards, 1 committed earlier] 10 rows") and lines[-1].endswith(
        ", 40% of input, ETA 30s")
    now[0] += 110
    progress.shard_done(counts(20, 100), 10, earlier=1, nbytes=100)
    assert progress.eta_s() == 500 * 120 / 300 and lines[-1].endswith(", 50% of input, ETA 3m20s")


def test_a_streamed_plan_on_a_terminal_gets_a_byte_bar_with_eta():
    stream = io.StringIO()
    bar = ProgressBar(stream, lambda msg: stream.write(msg + "\n"))
    bar.start(None, None, total_bytes=400)
    bar.shard_done(counts(10, 80), 10, nbytes=100)
    bar.shard_done(counts(20, 160, errors=1), 10, nbytes=100)
    bar.close()
    last = stream.getvalue().replace("\r", "\n").strip().splitlines()[-1]
    assert "generating:  50%" in last and "ETA " in last and "20 rows" in last
    assert "row/s" in last and "tok/s, 1 errors, 2 shards" in last


def test_without_sizes_a_streamed_plan_still_counts_rows():
    lines = []
    progress = Progress(lines.append)
    progress.start(None, None, total_bytes=None)
    progress.shard_done(counts(10, 50), 10, nbytes=100)
    assert lines[-1].startswith("[1 shards] 10 rows") and lines[-1].endswith(" tok/s")
