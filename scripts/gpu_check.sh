#!/usr/bin/env bash
# The CUDA check, one command, for a CUDA machine with no network (bounded at 7.7 minutes; each stage prints as it goes):
#   0. the Triton attention kernels against the torch references, compiled (tests/engine/test_triton_attention.py);
#   1. the GPU tests: fp32 parity with transformers with CUDA graphs on, graphs == eager, bf16 agreement;
#   2. the throughput table (scripts/bench_gpu.py: 1.2B Llama, random weights) and a decode profile;
#   3. prefix caching on vs off (scripts/bench_prefix.py on the GPU).
# Results go to $OUT (default results/gpu_check). Wheels in .whl/ (e.g. transformers>=5.24 where the
# machine has an older one) are installed to /tmp/site first. Runs with the machine's python3:
# the engine needs no Ray.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-results/gpu_check}"
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the repository's packages, uninstalled
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch, transformers; print("torch", torch.__version__, "| transformers", transformers.__version__)' | tee -a "$OUT/gpu.txt"
python3 -c 'import triton; print("triton", triton.__version__)' 2>&1 | tee -a "$OUT/gpu.txt"
rc=0
stage() {  # stage SECONDS LOG COMMAND...: bounded, logged, timed; a failure marks the check failed
    local limit=$1 log=$2 start=$SECONDS; shift 2
    echo "== $* (limit ${limit}s)"
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$log" || rc=1
    echo "== took $((SECONDS - start))s"
}
stage 60 kernel_tests.log python3 -m pytest tests/engine/test_triton_attention.py -q -p no:cacheprovider
stage 120 gpu_tests.log python3 -m pytest tests/engine/test_gpu.py -m gpu -q -s -p no:cacheprovider
stage 220 bench_gpu.log python3 scripts/bench_gpu.py --json "$OUT/bench_gpu.json" "$@"
stage 60 bench_prefix.log python3 scripts/bench_prefix.py --device cuda --requests 256
exit $rc
