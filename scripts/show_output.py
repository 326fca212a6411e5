#!/usr/bin/env python
"""Prints the first rows of a job's output, read through the part index its manifest points to.

    .venv/bin/python scripts/show_output.py OUTPUT_DIR [--rows 5]
"""
from __future__ import annotations

import argparse
import json

import fsspec

from pipeline.index import part_entries
from pipeline.io import decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("output")
    ap.add_argument("--rows", type=int, default=5)
    args = ap.parse_args()
    fs, root = fsspec.core.url_to_fs(args.output)
    manifest = json.loads(fs.cat_file(root.rstrip("/") + "/manifest.json"))
    shown = parts = 0
    for part in part_entries(args.output):
        parts += 1
        if shown == args.rows:
            continue
        with fsspec.open(part["path"], "rb") as f:
            table = decode(f.read(), manifest["format"])
        for row in table.to_pylist():
            if shown == args.rows:
                break
            text = row["generated_text"] if row["finish_reason"] != "error" else f"ERROR: {row['error']}"
            asked = row.get("messages")
            asked = asked[-1]["content"] if asked else row.get("prompt", "")
            print(f"{row['id']}: {asked!r}\n    -> {text!r} [{row['finish_reason']}, "
                  f"{row['num_generated_tokens']} tokens]")
            shown += 1
    print(f"... {manifest['rows']} rows in {parts} parts under {args.output}")


if __name__ == "__main__":
    main()
