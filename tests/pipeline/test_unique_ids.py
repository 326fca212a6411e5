"""The unique-id check: Ray tasks hash the ids of the input by blocks and partitions, no process holding every id."""
import pytest

from pipeline.errors import JobError
from pipeline.io import Storage, list_inputs
from pipeline.run.shards.planner import ShardPlan
from pipeline.run.shards.unique_ids import check_unique_ids
from pipeline.spec import validate

pytestmark = pytest.mark.usefixtures("ray_local")


def spec_for(path, out):
    """A spec with the parts the id check reads."""
    return validate({"input": {"path": str(path), "id_column": "id"}, "output": {"path": str(out), "format": "parquet"},
                     "workers": {"rows_per_batch": 4, "shard_bytes": 1 << 20}})


def test_duplicates_across_files_and_shards_are_named(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("".join(f'{{"id": "r{i}", "prompt": "p"}}\n' for i in range(30)))
    (tmp_path / "in" / "b.jsonl").write_text('{"id": "r7", "prompt": "again"}\n')
    spec = spec_for(tmp_path / "in", tmp_path / "out")
    files = list_inputs(Storage(str(tmp_path / "in")), "auto")
    plan = ShardPlan(4, 1 << 20, segment_bytes=200)  # a.jsonl in 5 segments
    with pytest.raises(JobError, match="duplicate id 'r7' in column 'id'"):
        check_unique_ids(spec, files, plan)
    (tmp_path / "in" / "b.jsonl").write_text('{"id": "r99", "prompt": "fresh"}\n')
    check_unique_ids(spec, files, plan)


def test_both_places_are_named_in_every_partitioning_and_format(tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.run.shards import unique_ids
    from pipeline.run.shards.unique_ids import find_duplicate, still_duplicated

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("".join(f'{{"id": "r{i}", "prompt": "p"}}\n' for i in range(30))
                                             + '{"prompt": "no id"}\n{"id": null, "prompt": "null id"}\n')
    pq.write_table(pa.table({"id": [f"q{i}" for i in range(40)] + [None, None], "prompt": ["p"] * 42}),
                   tmp_path / "in" / "b.parquet")
    spec = spec_for(tmp_path / "in", tmp_path / "out")
    files = list_inputs(Storage(str(tmp_path / "in")), "auto")
    whole, segmented = ShardPlan(4, 1 << 20), ShardPlan(4, 1 << 20, segment_bytes=200)
    for parts_per_byte in (1 << 30, 64):  # one partition; then about a dozen
        monkeypatch.setattr(unique_ids, "BYTES_PER_PART", parts_per_byte)
        assert find_duplicate(spec, files, whole) is None  # rows without an id (missing, null) are not ids
        (tmp_path / "in" / "c.jsonl").write_text('{"id": "q7", "prompt": "again"}\n')
        files = list_inputs(Storage(str(tmp_path / "in")), "auto")
        found = find_duplicate(spec, files, whole)
        assert found.line() == "duplicate id 'q7' in column 'id': b.parquet row 7 and c.jsonl row 0 (ids must be unique)"
        (tmp_path / "in" / "c.jsonl").write_text('{"id": "r21", "prompt": "again"}\n')
        found = find_duplicate(spec, files, segmented)
        assert found.id == "r21" and str(found.places[1]) == "c.jsonl row 0"
        assert str(found.places[0]).startswith("a.jsonl line ") and " after byte " in str(found.places[0])
        # a rerun finds it where it was while the input holds it there, and not once it is gone
        assert still_duplicated(spec, files, segmented, found.to_json()) == found
        (tmp_path / "in" / "c.jsonl").write_text('{"id": "r99", "prompt": "fresh"}\n')
        assert still_duplicated(spec, files, segmented, found.to_json()) is None
        (tmp_path / "in" / "c.jsonl").unlink()
        files = list_inputs(Storage(str(tmp_path / "in")), "auto")
