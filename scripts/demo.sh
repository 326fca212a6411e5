#!/usr/bin/env bash
# Sets up (if needed), then runs a real job with the embedded default model (builtin:tiny) over
# configs/data/prompts.jsonl through `batchinfer run`, and prints some of the results.
# builtin:tiny has random weights: its text is noise, but every step of the job is real.
# Extra arguments go to `batchinfer run`, e.g. scripts/demo.sh --set sampling.max_tokens=8
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
export TOKENIZERS_PARALLELISM=false
.venv/bin/batchinfer run configs/demo.yaml --overwrite "$@"
.venv/bin/python scripts/show_output.py out/demo/ --rows 6
