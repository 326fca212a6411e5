#!/usr/bin/env bash
# The CUDA check, one command, for a CUDA machine with no network: scripts/gpu_check.py's stages
# (the engine's self-check and CPU parity first, then the kernels, the GPU tests, the default
# suite's engine tests on the GPU, then a benchmark), bounded at 8 minutes in all, machine start
# excluded. `--dry-run` prints the stages, their bounds and commands without CUDA; `--from STAGE`
# reruns from a stage. Results go to $OUT (default results/gpu_check): gpu_check.json,
# gpu_check.log and each stage's figures. Wheels in .whl/ (e.g. transformers>=5.24 where the
# machine has an older one) are installed to /tmp/site first. Runs with the machine's python3:
# the engine needs no Ray.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the repository's packages, uninstalled
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY="${PYTHON:-python3}"
for arg in "$@"; do
    if [ "$arg" = "--dry-run" ]; then exec "$PY" scripts/gpu_check.py "$@"; fi
done
export OUT="${OUT:-results/gpu_check}"
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "$PY" -c 'import torch, transformers; print("torch", torch.__version__, "| transformers", transformers.__version__)'
    "$PY" -c 'import triton; print("triton", triton.__version__)' 2>&1
} | tee "$OUT/gpu.txt"
exec "$PY" scripts/gpu_check.py "$@"
