"""Progress reporters: plain lines off a terminal, a bar with rows, tokens/s and ETA on one."""
from __future__ import annotations

import io

from pipeline.progress import Progress, ProgressBar, as_progress


def counts(rows, tokens, errors=0):
    return {"rows": rows, "errors": errors, "generated_tokens": tokens}


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
