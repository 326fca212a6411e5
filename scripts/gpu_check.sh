#!/usr/bin/env bash
# The CUDA check, one command, for a CUDA machine with no network (bounded at 7.6 minutes, so a
# session's 15 device minutes leave room for the machine's start and a rerun of its first stages;
# each stage prints as it goes, and a stage past its bound is cut and marks the check failed):
#   0. the Triton attention kernels against the torch references, compiled (tests/engine/test_triton_attention.py);
#   1. the GPU tests: fp32 parity with transformers with CUDA graphs on, graphs == eager, bf16 agreement,
#      int8 / int4 / fp8 against bf16 with their load peaks;
#   2. the 1.2B throughput table (scripts/bench_gpu.py --quick: 128 requests) and a decode profile;
#   3. the 1.2B workload quantized: bf16 vs int8 vs int4 vs fp8 tok/s and load peaks (--quantization);
#   4. the 8B workload (scripts/bench_gpu.py --workload 8b): the engine against the limit it computes.
# Prefix caching on the GPU (scripts/bench_prefix.py --device cuda) is left to a run by hand.
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
stage 40 kernel_tests.log python3 -m pytest tests/engine/test_triton_attention.py -q -p no:cacheprovider
stage 75 gpu_tests.log python3 -m pytest tests/engine/test_gpu.py -m gpu -q -s -p no:cacheprovider
stage 50 bench_gpu.log python3 scripts/bench_gpu.py --quick --skip-eager --json "$OUT/bench_gpu.json" "$@"
stage 80 bench_gpu_quant.log python3 scripts/bench_gpu.py --quick --quantization int8,int4,fp8 \
    --json "$OUT/bench_gpu_quant.json"
stage 210 bench_gpu_8b.log python3 scripts/bench_gpu.py --workload 8b --json "$OUT/bench_gpu_8b.json" \
    --model-dir /tmp/bench_gpu_8b
exit $rc
