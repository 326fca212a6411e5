"""The README stays true: every spec field is documented, and the shipped configs validate."""
from pathlib import Path

import pytest

from jobs.spec import field_reference, load_spec

ROOT = Path(__file__).resolve().parents[2]


def test_readme_documents_every_spec_field():
    readme = (ROOT / "README.md").read_text()
    missing = [key for key, *_ in field_reference() if f"`{key}`" not in readme]
    assert not missing, f"README lacks spec fields: {missing}"


@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_validate_and_say_what_they_are_for(config):
    first = config.read_text().splitlines()[0]
    assert first.startswith("# ") and len(first) > 10, "each config starts with a one-line purpose comment"
    load_spec(config)
