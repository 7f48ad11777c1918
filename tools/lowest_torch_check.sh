#!/usr/bin/env bash
# Builds the extension against the lowest supported torch (pyproject.toml: torch>=2.11, the release on the
# lent GPU machines) in its own venv outside the clone (VCPO_LOWEST_TORCH_VENV, default
# ~/.cache/vcpo/torch-2.11-venv: about 4 GB, made when missing), in a copy of the tracked files, and runs a
# quick subset of the tests there: the ops against the reference, the options, opcheck and torch.compile.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH="${VCPO_LOWEST_TORCH:-2.11.0}"
VENV="${VCPO_LOWEST_TORCH_VENV:-$HOME/.cache/vcpo/torch-${TORCH%.*}-venv}"
if ! "$VENV/bin/python" -c "import torch; assert torch.__version__.split('+')[0] == '$TORCH'" 2>/dev/null; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "torch==$TORCH" numpy pytest expecttest setuptools wheel ninja
fi
COPY="$(mktemp -d)"
trap 'rm -rf "$COPY"' EXIT
git ls-files -z | xargs -0 cp --parents -t "$COPY"
cd "$COPY"
VCPO_BUILD_CUDA=0 "$VENV/bin/python" setup.py -q build_ext --inplace > build.log 2>&1 || { grep -E -B2 -A8 "error:" build.log | head -80; exit 1; }
"$VENV/bin/python" -c "import torch, vcpo_kernels as vk; assert 'cpu' in vk.available_backends('cpu'); print('torch', torch.__version__)"
"$VENV/bin/python" -m pytest -q --full -p no:cacheprovider tests/kernels/test_backends_vs_reference.py tests/kernels/test_option_codes.py \
  tests/kernels/test_compile_and_autograd.py tests/kernels/test_bad_input.py -k "not triton"
