#!/usr/bin/env bash
# Sets up (if needed), then generates completions with the embedded default model (builtin:tiny)
# and prints them. builtin:tiny has random weights: its text is noise, but every step is real.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
exec .venv/bin/python scripts/demo.py "$@"
