"""No file of the project is one that .gitignore names: `ray job submit --working-dir .` uploads the
checkout without the paths .gitignore ignores, so a tracked module under an ignored name (a
package called results/, say) is missing on the cluster and every job there fails to import."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_no_tracked_file_is_ignored():
    ignored = subprocess.run(["git", "ls-files", "--cached", "--ignored", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    assert not ignored, f"tracked but ignored by .gitignore (Ray's working_dir upload leaves them out): {ignored[:10]}"
