#!/usr/bin/env bash
# On a GPU machine, from the repository root: build the extension with its CUDA kernels against the machine's
# own torch (in place; no pip, so the torch pin does not apply), run the GPU tests (every GPU backend against
# the float64 reference), then the benchmark table (bench/bench_gpu.py). About 5 minutes on one H100/H200
# (the CUDA compile about 2 of them).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export TRITON_INTERPRET=0  # tests/conftest.py would otherwise select Triton's CPU interpreter
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
time VCPO_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-16}" \
  "$PY" setup.py -q build_ext --inplace 2>&1 | grep -v -i "warning" | tail -5
time "$PY" -m pytest tests/test_gpu.py -q -x -p no:cacheprovider 2>&1 | tail -15
time "$PY" bench/bench_gpu.py "$@"
