#!/usr/bin/env bash
# Compile and link the CUDA kernels (csrc/cuda/) against the CUDA build of torch 2.13.0 on a machine without
# a GPU, then load the library and check that every vcpo op has its CPU and CUDA kernels registered.
# The venv lives outside the clone (VCPO_CUDA_VENV, default ~/.cache/vcpo/cuda-venv: about 4.7 GB) and is
# created when missing. Needs nvcc (CUDA_HOME, default /usr/local/cuda). About 2 minutes of nvcc.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VCPO_CUDA_VENV:-$HOME/.cache/vcpo/cuda-venv}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
if ! "$VENV/bin/python" -c "import torch; assert torch.version.cuda and torch.__version__.startswith('2.13.0')" \
    2>/dev/null; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "torch==2.13.0,!=2.13.0+cpu" numpy setuptools wheel ninja
fi
BUILD="$(mktemp -d)"
trap 'rm -rf "$BUILD"' EXIT
# sm_90 (H100/H200) only, to keep the compile short; a GPU machine builds for its own GPU.
# The compiler's output (torch's headers warn a lot) goes to a log, shown only if the build fails.
if ! VCPO_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-2}" \
  "$VENV/bin/python" setup.py -q build_ext --build-lib "$BUILD/lib" --build-temp "$BUILD/tmp" \
  > "$BUILD/build.log" 2>&1; then
  grep -E -B2 -A6 "error" "$BUILD/build.log" | head -200 || tail -100 "$BUILD/build.log"
  echo "CUDA build failed" >&2
  exit 1
fi
"$VENV/bin/python" - "$BUILD"/lib/vcpo_kernels/_C*.so <<'PY'
import sys

import torch

torch.ops.load_library(sys.argv[1])
ops = ["sequence_stats", "effective_sample_size", "opob_baseline", "policy_loss", "policy_loss_backward",
       "logit_rows_forward", "logit_rows_backward"]
missing = [(op, key) for op in ops for key in ("CPU", "CUDA")
           if not torch._C._dispatch_has_kernel_for_dispatch_key(f"vcpo::{op}", key)]
assert not missing, f"ops without a kernel: {missing}"
assert torch._C._dispatch_has_kernel_for_dispatch_key("vcpo::policy_loss", "Autograd")
print(f"CUDA build ({torch.__version__}): every vcpo op has its CPU and CUDA kernels")
PY
