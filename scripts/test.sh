#!/usr/bin/env bash
# Sets up (if needed) and runs the whole test suite, slow tests included; prints how long it took.
# Extra arguments go to pytest, e.g. scripts/test.sh -k parity -x
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
bash scripts/setup_airflow.sh
export TOKENIZERS_PARALLELISM=false
started=$(date +%s)
set +e
.venv/bin/python -m pytest "$@"
code=$?
set -e
took=$(( $(date +%s) - started ))
echo "test suite: ${took}s ($((took / 60))m$(printf '%02d' $((took % 60)))s), pytest exit ${code}"
exit "$code"
