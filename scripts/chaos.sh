#!/usr/bin/env bash
# Runs the fault scenarios (driver SIGKILLs, actor crashes, node loss, object-storage throttling,
# a failing actor constructor, a tensor-parallel rank SIGKILLed mid-shard) against real jobs and prints a table: scenario, rows in, rows out,
# duplicates, lost, outcome, and the evidence that the fault fired. Exits non-zero if a fault did not
# fire or any id was lost or duplicated. The harness and the faults live in tests/chaos/.
#   scripts/chaos.sh                      # all scenarios (~8 minutes on 2 cores)
#   scripts/chaos.sh "actor constructor fails"
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
bash scripts/setup.sh
export TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$root/tests${PYTHONPATH:+:$PYTHONPATH}"
exec .venv/bin/python -m chaos.harness "$@"
