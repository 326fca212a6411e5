"""The unique-id check: in the driver for small inputs, as a Ray Data group-by for large ones."""
import pytest

from pipeline import runner
from pipeline.runner import JobError, _check_unique_ids
from pipeline.source import list_inputs, plan_shards
from pipeline.storage import Storage


def spec_for(path):
    """The parts of a spec dict the id check reads."""
    return {"input": {"path": str(path), "storage_options": {}, "id_column": "id"}}


@pytest.mark.parametrize("distributed", [False, True])
def test_duplicates_across_shards_are_named(tmp_path, monkeypatch, distributed, request):
    if distributed:
        request.getfixturevalue("ray_local")
        monkeypatch.setattr(runner, "LOCAL_ID_CHECK_ROWS", 0)
    (tmp_path / "a.jsonl").write_text("".join(f'{{"id": "r{i}", "prompt": "p"}}\n' for i in range(30)))
    (tmp_path / "b.jsonl").write_text('{"id": "r7", "prompt": "again"}\n')
    spec = spec_for(tmp_path)
    storage = Storage(str(tmp_path))
    shards = list(plan_shards(storage, list_inputs(storage, "auto"), 4))
    with pytest.raises(JobError, match="duplicate id 'r7' in column 'id'"):
        _check_unique_ids(spec, shards, None)
    (tmp_path / "b.jsonl").write_text('{"id": "r99", "prompt": "fresh"}\n')
    _check_unique_ids(spec, list(plan_shards(storage, list_inputs(storage, "auto"), 4)), None)
