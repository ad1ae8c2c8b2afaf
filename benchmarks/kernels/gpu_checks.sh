#!/usr/bin/env bash
# Every GPU check in one run, from the repo root of a CUDA machine: the Triton kernels' tests compiled
# for the GPU, benchmarks/kernels/gpu.py, and (given a laptop artifact) the artifact's reference run recorded on
# the GPU as a parity trace, to check on CPU with `parity --artifact DIR --against trace_cuda.safetensors`.
# Usage: bash benchmarks/kernels/gpu_checks.sh OUT_DIR [ARTIFACT_DIR]      (PYTHON picks the interpreter)
set -u -o pipefail
out=${1:?usage: bash benchmarks/kernels/gpu_checks.sh OUT_DIR [ARTIFACT_DIR]}
artifact=${2:-}
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$out"
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/nvidia-smi.csv" || status=1
TRITON_INTERPRET=0 timeout 300 "$py" -m pytest -q -p no:cacheprovider tests/kernels/test_triton.py 2>&1 \
    | tee "$out/triton_tests.log" || status=1
timeout 300 "$py" -m benchmarks.kernels.gpu --out "$out/gpu.json" 2>&1 | tee "$out/gpu.log" || status=1
if [ -n "$artifact" ]; then
    timeout 180 "$py" -m oscar_export parity --artifact "$artifact" --prompt-tokens 200 --steps 16 \
        --save-trace "$out/trace_cuda.safetensors" 2>&1 | tee "$out/parity.log" || status=1
fi
exit $status
