#!/usr/bin/env bash
# Idempotent setup: creates .venv/ in the repo root and installs batchinfer with its test extra.
# torch goes in first so that pip never pulls a multi-GB CUDA build as a dependency.
# TORCH_SPEC overrides the torch requirement (e.g. TORCH_SPEC='torch==2.13.0' on a CUDA host
# with --index-url set through PIP_INDEX_URL); PYTHON picks the interpreter.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-python3}"
torch_spec="${TORCH_SPEC:-torch==2.13.0}"
stamp=".venv/.batchinfer-setup"
want="$(cat setup.cfg pyproject.toml; echo "$torch_spec")"

if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv with $("$python" --version)"
    "$python" -m venv .venv
fi
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0  # already set up for this setup.cfg
fi
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)
"${pip[@]}" install --upgrade pip setuptools wheel
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
    echo "[setup] installing $torch_spec"
    "${pip[@]}" install "$torch_spec"
fi
echo "[setup] installing batchinfer and its dependencies"
"${pip[@]}" install -e '.[test]'
printf '%s' "$want" > "$stamp"
echo "[setup] done: $(.venv/bin/python -c 'import torch, transformers, ray; print("torch", torch.__version__, "| transformers", transformers.__version__, "| ray", ray.__version__)')"
