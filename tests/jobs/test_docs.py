"""The docs stay true: every spec field is documented in docs/jobs.md, whose spec table is the one
scripts/spec_table.py writes; the README's spec is a valid spec; and the shipped configs validate."""
import re
import runpy
from pathlib import Path

import pytest

from jobs.spec import field_reference, load_spec

ROOT = Path(__file__).resolve().parents[2]
JOBS_DOC = ROOT / "docs" / "jobs.md"


def test_docs_jobs_documents_every_spec_field():
    text = JOBS_DOC.read_text()
    missing = [key for key, *_ in field_reference() if f"`{key}`" not in text]
    assert not missing, f"docs/jobs.md lacks spec fields: {missing}"


def test_the_spec_table_in_docs_jobs_is_the_one_spec_table_writes():
    """Fix with: .venv/bin/python scripts/spec_table.py --update docs/jobs.md"""
    script = runpy.run_path(str(ROOT / "scripts" / "spec_table.py"), run_name="spec_table")
    expected = script["table"]()
    found = re.search(re.escape(script["HEADER"]) + r"(\|.*\|\n)*", JOBS_DOC.read_text())
    assert found, "docs/jobs.md holds no spec table"
    assert found.group(0) == expected, "docs/jobs.md's spec table is stale: run scripts/spec_table.py --update docs/jobs.md"


def test_the_readme_spec_is_a_valid_spec(tmp_path):
    blocks = re.findall(r"```yaml\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks, "the README shows a job spec"
    for block in blocks:
        spec = tmp_path / "job.yaml"
        spec.write_text(block)
        load_spec(spec)


@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_validate_and_say_what_they_are_for(config):
    first = config.read_text().splitlines()[0]
    assert first.startswith("# ") and len(first) > 10, "each config starts with a one-line purpose comment"
    load_spec(config)
