"""The unique-id check: a Ray Data group-by over the planned input, no process holding every id."""
import pytest

from pipeline.errors import JobError
from pipeline.io import Storage, list_inputs
from pipeline.run.planner import ShardPlan
from pipeline.run.unique_ids import check_unique_ids
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
