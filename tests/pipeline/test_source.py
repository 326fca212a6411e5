"""Listing, shard planning and shard reading: ids stable, every row in exactly one shard."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.errors import InputError
from pipeline.io import Storage, list_inputs, plan_shards, read_shard
from pipeline.io import source
from pipeline.io.formats import jsonl


def write_jsonl(path, rows, trailing_newline=True, blank_every=0):
    lines = []
    for i, r in enumerate(rows):
        lines.append(json.dumps(r))
        if blank_every and i % blank_every == 0:
            lines.append("")
    path.write_text("\n".join(lines) + ("\n" if trailing_newline else ""))


def read_all(storage, shards):
    """(ids, rows, errors) of every shard, in order."""
    ids, rows, errors = [], [], []
    for shard in shards:
        for row in read_shard(storage, shard):
            rows.append(row.values)
            ids.append(row.id)
            errors.append(row.error)
    return ids, rows, errors


def all_rows(storage, rows_per_shard):
    files = list_inputs(storage, "auto")
    shards = list(plan_shards(storage, files, rows_per_shard))
    ids, rows, errors = read_all(storage, shards)
    assert all(err is None for err in errors)
    return shards, ids, rows


@pytest.mark.parametrize("trailing", [True, False])
@pytest.mark.parametrize("per_shard", [1, 7, 1000])
def test_jsonl_shards_cover_every_line_once(tmp_path, monkeypatch, trailing, per_shard):
    monkeypatch.setattr(jsonl, "BLOCK", 64)  # force shard boundaries to straddle read blocks
    data = [{"prompt": f"p{i}", "n": i} for i in range(53)]
    write_jsonl(tmp_path / "a.jsonl", data, trailing_newline=trailing)
    shards, ids, rows = all_rows(Storage(str(tmp_path)), per_shard)
    assert [r["n"] for r in rows] == list(range(53))
    assert ids == [f"a.jsonl:{i}" for i in range(53)]
    assert all(s.stop - s.start <= per_shard for s in shards)
    assert len({s.key for s in shards}) == len(shards)


def test_blank_lines_are_skipped_and_ids_are_line_numbers(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"prompt": str(i)} for i in range(5)], blank_every=2)
    _, ids, rows = all_rows(Storage(str(tmp_path / "a.jsonl")), 2)
    assert [r["prompt"] for r in rows] == ["0", "1", "2", "3", "4"]
    assert ids == ["a.jsonl:0", "a.jsonl:2", "a.jsonl:3", "a.jsonl:5", "a.jsonl:6"]


def test_parquet_shards_span_row_groups(tmp_path):
    table = pa.table({"prompt": [f"p{i}" for i in range(100)], "n": list(range(100))})
    pq.write_table(table, tmp_path / "x.parquet", row_group_size=13)
    shards, ids, rows = all_rows(Storage(str(tmp_path)), 30)
    assert [(s.start, s.stop) for s in shards] == [(0, 30), (30, 60), (60, 90), (90, 100)]
    assert [r["n"] for r in rows] == list(range(100)) and ids[42] == "x.parquet:42"


def test_listing_directories_globs_and_hidden_files(tmp_path):
    (tmp_path / "sub").mkdir()
    write_jsonl(tmp_path / "b.jsonl", [{"prompt": "b"}])
    write_jsonl(tmp_path / "sub" / "a.json", [{"prompt": "a"}])
    write_jsonl(tmp_path / ".hidden.jsonl", [{"prompt": "h"}])
    (tmp_path / "_SUCCESS").write_text("")
    (tmp_path / "notes.txt").write_text("x")
    names = [n for _, n, _ in list_inputs(Storage(str(tmp_path)), "auto")]
    assert names == ["b.jsonl", "sub/a.json"]
    names = [n for _, n, _ in list_inputs(Storage(str(tmp_path / "*.jsonl")), "auto")]
    assert names == ["b.jsonl"]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_subfolders_are_listed_in_parallel_and_hidden_ones_not_at_all(tmp_path, request, monkeypatch, where):
    """A partitioned input: the top level is listed once and each visible subfolder by its own
    thread (three listings meet at a barrier, which fails if they run one after another); the
    files, names and sizes are those of a plain recursive listing."""
    import threading

    for part in ("date=1", "date=2", "date=3/hour=0", "_temporary"):
        (tmp_path / part).mkdir(parents=True)
        write_jsonl(tmp_path / part / "p.jsonl", [{"prompt": part}])
    write_jsonl(tmp_path / "top.jsonl", [{"prompt": "t"}])
    if where == "s3":
        import s3fs

        endpoint = request.getfixturevalue("s3_server")
        s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}).put(
            f"{tmp_path}/", "list-parallel/in/", recursive=True)
        storage = Storage("s3://list-parallel/in", {"endpoint_url": endpoint})
    else:
        storage = Storage(str(tmp_path))
    find, barrier, listed = storage.fs.find, threading.Barrier(3, timeout=10), []

    def meet(path, **kw):
        listed.append(path.rsplit("/", 1)[-1])
        barrier.wait()
        return find(path, **kw)

    monkeypatch.setattr(storage.fs, "find", meet)
    files = list_inputs(storage, "auto")
    assert sorted(listed) == ["date=1", "date=2", "date=3"]
    assert [n for _, n, _ in files] == ["date=1/p.jsonl", "date=2/p.jsonl", "date=3/hour=0/p.jsonl", "top.jsonl"]
    assert files.sizes == [(tmp_path / n).stat().st_size for _, n, _ in files]


def test_no_inputs_is_fatal(tmp_path):
    with pytest.raises(InputError, match="no input files"):
        list_inputs(Storage(str(tmp_path)), "auto")
    with pytest.raises(InputError, match="input not found"):
        list_inputs(Storage(str(tmp_path / "missing.jsonl")), "auto")


def test_malformed_line_is_a_row_error_naming_file_and_line(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(b'{"prompt": "ok"}\n{oops\n[1, 2]\n\xff\xfe\n')
    storage = Storage(str(tmp_path))
    shard = next(plan_shards(storage, list_inputs(storage, "auto"), 100))
    read = read_shard(storage, shard)
    rows, ids, errors = [r.values for r in read], [r.id for r in read], [r.error for r in read]
    assert errors[0] is None and rows[0] == {"prompt": "ok"}
    assert "a.jsonl line 2: malformed JSON" in errors[1]
    assert "expected a JSON object" in errors[2]
    assert "a.jsonl line 4" in errors[3]
    assert len(ids) == 4


@pytest.mark.parametrize("block", [16, 64, 1 << 20])
@pytest.mark.parametrize("shard_bytes,rows_cap", [(1, None), (100, None), (100, 3), (10_000, None)])
def test_byte_target_shards_align_to_lines_and_keep_the_derived_ids(tmp_path, monkeypatch, block, shard_bytes,
                                                                     rows_cap):
    monkeypatch.setattr(jsonl, "BLOCK", block)
    data = [{"prompt": "p" * (i % 17), "n": i} for i in range(61)]
    write_jsonl(tmp_path / "a.jsonl", data, blank_every=9)
    storage = Storage(str(tmp_path))
    shards = list(plan_shards(storage, list_inputs(storage, "auto"), rows_cap, shard_bytes))
    ids, rows, _ = read_all(storage, shards)
    _, by_rows, _ = all_rows(storage, 1000)
    assert ids == by_rows and [r["n"] for r in rows] == list(range(61))
    raw = (tmp_path / "a.jsonl").read_bytes()
    for s in shards:
        assert s.byte_start == 0 or raw[s.byte_start - 1:s.byte_start] == b"\n"  # starts on a line
        assert raw.count(b"\n", s.byte_start, s.byte_stop) == s.stop - s.start
        assert rows_cap is None or s.stop - s.start <= rows_cap
    assert all(s.byte_stop - s.byte_start >= shard_bytes for s in shards[:-1] if rows_cap is None)
    assert shards[-1].byte_stop == len(raw)


def test_listing_sums_input_sizes_and_shards_split_each_file_s_bytes(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"p{i}"} for i in range(40)])
    pq.write_table(pa.table({"prompt": [f"q{i}" for i in range(90)]}), tmp_path / "b.parquet", row_group_size=20)
    (tmp_path / "_SUCCESS").write_text("")  # left out of the listing, and of its size
    storage = Storage(str(tmp_path))
    files = list_inputs(storage, "auto")
    sizes = {"a.jsonl": (tmp_path / "a.jsonl").stat().st_size, "b.parquet": (tmp_path / "b.parquet").stat().st_size}
    assert [n for _, n, _ in files] == ["a.jsonl", "b.parquet"] and files.total_bytes == sum(sizes.values())
    for cap in (7, 25, None):
        shards = list(plan_shards(storage, files, cap, 1 << 20))
        for name, size in sizes.items():  # a file's shards cover its bytes exactly once, in order
            spans = [(s.byte_start, s.byte_stop) for s in shards if s.name == name]
            assert spans[0][0] == 0 and spans[-1][1] == size
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])) and all(lo < hi for lo, hi in spans)


def test_planning_tasks_take_few_files_and_large_files_alone(monkeypatch):
    from pipeline.io import InputFiles
    from pipeline.run.shards import planner

    def listing(sizes):
        files = InputFiles((f"/in/{i}", f"{i}", "jsonl") for i in range(len(sizes)))
        files.sizes = list(sizes)
        return files

    def groups(sizes):
        return planner.plan_groups(planner.plan_units(listing(sizes)))

    mib = 1 << 20
    assert groups([mib] * 20) == [list(range(8)), list(range(8, 16)), list(range(16, 20))]
    big = planner.BYTES_PER_PLAN_TASK
    assert groups([mib, big, mib, mib, 2 * big, mib]) == [[0], [1], [2, 3], [4], [5]]
    assert groups([None] * 9) == [list(range(8)), [8]]  # no sizes: by count
    assert planner.plan_blocks(listing([mib] * 20)) == 3
    # in segments, a large JSONL file is planned by several tasks; a Parquet file stays whole
    units = planner.plan_units(listing([mib, 2 * big + 5, mib]), segment_bytes=big)
    assert [(u.segment, u.segments, u.start, u.stop) for u in units] == [
        (0, 1, 0, -1), (0, 3, 0, big), (1, 3, big, 2 * big), (2, 3, 2 * big, 2 * big + 5), (0, 1, 0, -1)]
    assert planner.plan_groups(units) == [[0], [1], [2], [3, 4]]
    assert planner.plan_blocks(listing([mib, 2 * big + 5]), big) == 4
    parquet = listing([3 * big])
    parquet[0] = ("/in/0", "0", "parquet")
    assert len(planner.plan_units(parquet, big)) == 1
    monkeypatch.setattr(planner, "MAX_PLAN_BLOCKS", 3)  # the cap wins: limits are raised
    capped = groups([big] * 10)
    assert len(capped) <= 3 and sorted(i for g in capped for i in g) == list(range(10))


@pytest.mark.parametrize("segment", [1, 7, 50, 333, 10_000])
@pytest.mark.parametrize("shard_bytes,rows_cap", [(64, None), (1 << 20, None), (100, 3)])
@pytest.mark.parametrize("trailing_newline", [True, False])
def test_segments_planned_apart_cover_every_line_once_with_its_number(tmp_path, monkeypatch, segment, shard_bytes,
                                                                      rows_cap, trailing_newline):
    """Byte segments planned independently, their lines numbered by the counts of the segments
    before them, give shards that read every line exactly once with the ids of a whole-file plan:
    lines longer than a segment, blank lines and a last line without a newline included."""
    monkeypatch.setattr(jsonl, "BLOCK", 32)
    data = [{"prompt": "p" * (i * 37 % 211), "n": i} for i in range(45)]
    write_jsonl(tmp_path / "a.jsonl", data, trailing_newline=trailing_newline, blank_every=7)
    storage = Storage(str(tmp_path))
    path = str(tmp_path / "a.jsonl")
    size = (tmp_path / "a.jsonl").stat().st_size
    shards, before = [], 0
    for start in range(0, size, segment):
        local, lines = source.plan_segment(storage, path, "a.jsonl", start, min(size, start + segment), rows_cap,
                                           shard_bytes)
        assert all(s.start >= 0 and s.stop <= lines for s in local)
        shards += [source.Shard(s.file, s.name, s.format, s.start + before, s.stop + before, s.byte_start,
                                s.byte_stop) for s in local]
        before += lines
    ids, rows, _ = read_all(storage, shards)
    _, whole, _ = all_rows(storage, 1000)
    assert ids == whole and [r["n"] for r in rows] == list(range(45))
    assert [(a.stop, a.byte_stop) for a in shards[:-1]] == [(b.start, b.byte_start) for b in shards[1:]]
    assert shards[0].byte_start == 0 and shards[-1].byte_stop == size
    if segment >= size:  # one segment is the whole-file plan
        assert shards == list(plan_shards(storage, list_inputs(storage, "auto"), rows_cap, shard_bytes))


def test_the_line_sequencer_answers_each_segment_once_those_before_it_reported():
    import asyncio

    from pipeline.run.shards.planner import LineSequencer

    async def scenario():
        seq = LineSequencer()
        late = [asyncio.ensure_future(seq.offset("a", k, n)) for k, n in ((3, 4), (2, 5))]
        other = await seq.offset("b", 0, 9)  # files are numbered apart
        await asyncio.sleep(0)
        assert not any(f.done() for f in late)
        first = await seq.offset("a", 0, 10)
        await asyncio.sleep(0)
        assert not any(f.done() for f in late)
        second = await seq.offset("a", 1, 0)  # a segment with no line start
        again = await seq.offset("a", 1, 0)  # a retried task
        return other, first, second, again, [await f for f in late], await seq.offset("a", 4, 1)

    assert asyncio.run(scenario()) == (0, 0, 10, 10, [15, 10], 19)


def test_segments_on_object_storage_cut_as_on_local_disk(tmp_path, s3_server):
    """plan_segment's seeks and reads past a segment's end behave the same through s3fs."""
    import s3fs

    write_jsonl(tmp_path / "a.jsonl", [{"prompt": "q" * (i * 41 % 150), "n": i} for i in range(40)],
                trailing_newline=False)
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server})
    fs.mkdir("seg-s3")
    fs.put(str(tmp_path / "a.jsonl"), "seg-s3/a.jsonl")
    size = (tmp_path / "a.jsonl").stat().st_size
    cuts = {}
    for where, storage, path in (("local", Storage(str(tmp_path)), str(tmp_path / "a.jsonl")),
                                 ("s3", Storage("s3://seg-s3", {"endpoint_url": s3_server}), "seg-s3/a.jsonl")):
        cuts[where] = [(lines, [(s.start, s.stop, s.byte_start, s.byte_stop) for s in shards])
                       for start in range(0, size, 97)
                       for shards, lines in [source.plan_segment(storage, path, "a.jsonl", start,
                                                                 min(size, start + 97), None, 120)]]
    assert cuts["s3"] == cuts["local"] and sum(n for n, _ in cuts["local"]) == 40
