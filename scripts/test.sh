#!/usr/bin/env bash
# Sets up (if needed) and runs the whole test suite, slow tests included.
# Extra arguments go to pytest, e.g. scripts/test.sh -k parity -x
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
bash scripts/setup_airflow.sh
export TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest "$@"
