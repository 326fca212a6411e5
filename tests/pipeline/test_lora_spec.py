"""The lora section's rules, and what it does to the fingerprint: a job without it keeps its old
fingerprint; its adapter set is checked name by name on resume, not hashed in."""
from __future__ import annotations

import pytest

from pipeline.errors import SpecError
from pipeline.run.checks.adapters import adapters_conflict
from pipeline.spec import output_columns, validate

BASE = {"input": {"path": "in.jsonl"}, "output": {"path": "out"}}


def test_the_section_needs_a_routing_and_names_its_keys():
    with pytest.raises(SpecError, match="set lora.column .* or lora.each"):
        validate({**BASE, "lora": {"adapters": {"a": "/x"}}})
    with pytest.raises(SpecError, match="lora.include_base applies to lora.each"):
        validate({**BASE, "lora": {"adapters": {"a": "/x"}, "column": "c", "include_base": True}})
    with pytest.raises(SpecError, match="need adapters"):
        validate({**BASE, "lora": {"each": True}})
    spec = validate({**BASE, "lora": {"adapters": {"a": "/x"}, "each": True}})
    assert spec.engine_config().enable_lora and "adapter" in output_columns(spec)
    assert "adapter" not in output_columns(validate(BASE)) and not validate(BASE).engine_config().enable_lora


def test_the_fingerprint_ignores_which_adapters_but_counts_how_rows_pick_them():
    plain = validate(BASE).fingerprint()
    assert validate({**BASE, "engine": {"max_loras": 8, "max_lora_rank": 16}}).fingerprint() == plain
    one = validate({**BASE, "lora": {"adapters": {"a": "/x"}, "each": True}}).fingerprint()
    two = validate({**BASE, "lora": {"adapters": {"a": "/x", "b": "/y"}, "each": True}}).fingerprint()
    by_column = validate({**BASE, "lora": {"adapters": {"a": "/x"}, "column": "c"}}).fingerprint()
    assert one == two != plain and by_column not in (one, plain)


def test_a_resume_may_add_adapters_but_not_change_or_drop_one():
    assert adapters_conflict("out", {"a": "1"}, {"a": "1", "b": "2"}) is None
    assert "files changed" in adapters_conflict("out", {"a": "1"}, {"a": "3"})
    assert "no longer names" in adapters_conflict("out", {"a": "1", "b": "2"}, {"b": "2"})
