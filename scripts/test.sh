#!/usr/bin/env bash
# Sets up (if needed) and runs the test suite; prints how long it took.
# By default the tests marked slow are left out: long scenarios (chaos faults, resumes after a
# killed driver, `ray job submit`, cron, the shipped configs run whole), each with a fast sibling
# in the suite. `scripts/test.sh --slow` runs only those, `scripts/test.sh --all` everything;
# CI (.ci/run) runs the default part and a quarter of the slow one (--shard I/4).
# The default part spreads over processes (pytest-xdist), one test file at a time each, so
# that a file's module-scoped engines are built once: TEST_PROCESSES of them (default: one per core,
# at most 4; 0 runs in this process). Each takes its share of the cores for torch (tests/conftest.py).
# --slow and --all run in one process: the slow fault scenarios time kills and restarts.
# Other arguments go to pytest, e.g. scripts/test.sh -k parity -x (or -n 0 to debug in one process)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
marker=(-m "not slow")
cores="$(nproc 2>/dev/null || echo 1)"
processes="${TEST_PROCESSES:-$(( cores < 4 ? cores : 4 ))}"
case "${1:-}" in
    --slow) marker=(-m slow); processes=0; shift ;;
    --all) marker=(); processes=0; shift ;;
esac
spread=()
if [ "$processes" -gt 1 ]; then
    spread=(-n "$processes" --dist loadfile)
fi
bash scripts/setup.sh
bash scripts/setup_airflow.sh
export TOKENIZERS_PARALLELISM=false
# The project's own modules as bytecode, once: with PYTHONDONTWRITEBYTECODE set (as on CI), each
# Ray worker process would compile them again (about 0.7 s of CPU a process, a few per job).
.venv/bin/python -m compileall -q engine pipeline jobs >/dev/null
started=$(date +%s)
set +e
.venv/bin/python -m pytest ${marker[@]+"${marker[@]}"} ${spread[@]+"${spread[@]}"} "$@"
code=$?
set -e
took=$(( $(date +%s) - started ))
echo "test suite: ${took}s ($((took / 60))m$(printf '%02d' $((took % 60)))s), pytest exit ${code}"
exit "$code"
