#!/usr/bin/env python
"""Prints the job spec reference as a Markdown table (docs/jobs.md's "Job spec reference");
--update rewrites that table in place (tests/jobs/test_docs.py fails while it is stale).

    .venv/bin/python scripts/spec_table.py [--update docs/jobs.md]
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from jobs.spec import field_reference

HEADER = "| key | default | meaning |\n|---|---|---|\n"


def table() -> str:
    return HEADER + "".join(f"| `{key}` | {default.replace('|', '/')} | {desc.replace('|', '/')} |\n"
                            for key, _, default, desc in field_reference())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--update", type=Path, help="rewrite the table in this Markdown file in place")
    args = ap.parse_args()
    if not args.update:
        print(table(), end="")
        return
    text = args.update.read_text()
    pattern = re.compile(re.escape(HEADER) + r"(\|.*\|\n)*")
    if not pattern.search(text):
        raise SystemExit(f"no spec table in {args.update}")
    args.update.write_text(pattern.sub(lambda _: table(), text, count=1))


if __name__ == "__main__":
    main()
