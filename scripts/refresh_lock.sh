#!/usr/bin/env bash
# Re-resolves constraints.txt (the lock scripts/setup.sh installs with) to the newest versions the
# registry serves within setup.cfg's ranges, then sets .venv up with it and runs the default part of
# the tests. Run it on purpose and commit the new lock on its own; widening a range (admitting a new
# transformers, say) is a change to setup.cfg that this then tests. Arguments go to scripts/test.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python=.venv/bin/python
[ -x "$python" ] || python="${PYTHON:-python3}"  # resolved for the interpreter the setup uses
cp constraints.txt "${TMPDIR:-/tmp}/constraints.before.txt"
"$python" scripts/lock.py resolve
echo "[refresh] what changed (was -, now +):"
diff "${TMPDIR:-/tmp}/constraints.before.txt" constraints.txt | grep '^[<>] [^#]' | sed 's/^</-/; s/^>/+/' || echo "  nothing"
bash scripts/test.sh "$@"  # setup.sh sees the new lock (its stamp holds it) and installs it first
