#!/usr/bin/env bash
# The device check, from the repository root of a GPU machine:
#
#     bench/gpu_check.sh [--dry-run] [--stages build,tests,bench] [OUT_DIR]
#
# Stages, each run whatever the one before gave, each under its own time limit, each logged in full to OUT_DIR
# (default $VCPO_GPU_CHECK_OUT, else gpu-check-<time>/):
#   build  the extension with its CUDA kernels against the machine's own torch, in place (build.log)
#   tests  tests/kernels/test_gpu_backends.py: every GPU backend against the float64 reference (tests.log, tests.xml)
#   bench  bench/bench_gpu.py: the loss and LM-head tables (bench.txt)
# then summary.txt: each stage's status and seconds, and the failing tests by name. The exit status is the
# number of stages that did not pass. Expected on one H200: about 5 minutes (an estimate until it has run
# there: build 2, tests 1.5, bench 1.5), at most the sum of the limits below, 8.5 minutes.
#
# --dry-run rehearses the same plumbing on a machine without a GPU: build is the CUDA compile-and-link check
# (tools/cuda_build_check.sh), tests run the same file on the CPU (the GPU tests skip; their comparison bodies
# run with the CPU backends, Triton under its interpreter), bench runs at toy sizes on the CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
DRY=0
STAGES="build,tests,bench"
OUT=""
while (($#)); do
  case "$1" in
    --dry-run) DRY=1 ;;
    --stages) STAGES="$2"; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) OUT="$1" ;;
  esac
  shift
done
OUT="${OUT:-${VCPO_GPU_CHECK_OUT:-gpu-check-$(date +%Y%m%d-%H%M%S)}}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export PYTHONUNBUFFERED=1
if ((DRY)); then
  export TRITON_INTERPRET=1
  BUILD_LIMIT=900; TESTS_LIMIT=600; BENCH_LIMIT=600  # 2 CPU cores; the first CUDA build check installs a venv
else
  export TRITON_INTERPRET=0  # tests/conftest.py would otherwise select Triton's CPU interpreter
  BUILD_LIMIT=200; TESTS_LIMIT=150; BENCH_LIMIT=150
fi
FAILED=0
: > "$OUT/summary.txt"

# stage NAME LIMIT LOG COMMAND...: runs COMMAND under `timeout LIMIT` with its output in LOG; records the result.
stage() {
  local name="$1" limit="$2" log="$3" start status rc
  shift 3
  if [[ ",$STAGES," != *",$name,"* ]]; then
    echo "$name: skipped" | tee -a "$OUT/summary.txt"
    return
  fi
  echo "== $name (limit ${limit}s, log $log)"
  start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
  rc=$?
  case $rc in
    0) status="passed" ;;
    124|137) status="TIMED OUT after ${limit}s" ;;
    *) status="FAILED (exit $rc)" ;;
  esac
  ((rc == 0)) || FAILED=$((FAILED + 1))
  echo "$name: $status in $((SECONDS - start))s" | tee -a "$OUT/summary.txt"
}

{
  date -u
  git rev-parse HEAD 2>/dev/null
  if ((DRY)); then echo "dry run: no GPU"; else nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; fi
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  "$PY" -c "import triton; print('triton', triton.__version__)" 2>&1 | tail -1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if ((DRY)); then
  stage build "$BUILD_LIMIT" "$OUT/build.log" tools/cuda_build_check.sh
else
  stage build "$BUILD_LIMIT" "$OUT/build.log" env VCPO_BUILD_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" \
    MAX_JOBS="${MAX_JOBS:-16}" "$PY" setup.py build_ext --inplace
fi
grep -E -B2 -A4 "error" "$OUT/build.log" | head -40

# Workers compile Triton kernels in parallel on a GPU machine (pytest-xdist where it is installed).
PARALLEL=()
if ((!DRY)) && "$PY" -c "import xdist" 2>/dev/null; then PARALLEL=(-n 8); fi
stage tests "$TESTS_LIMIT" "$OUT/tests.log" "$PY" -m pytest tests/kernels/test_gpu_backends.py -v -rfE -p no:cacheprovider \
  "${PARALLEL[@]}" --junitxml="$OUT/tests.xml"
grep -E "^(FAILED|ERROR) " "$OUT/tests.log" | tee -a "$OUT/summary.txt" | head -40
grep -E "^=+ .*(passed|failed|error).* =+$" "$OUT/tests.log" | tail -1 | tee -a "$OUT/summary.txt"

if ((DRY)); then
  stage bench "$BENCH_LIMIT" "$OUT/bench.txt" "$PY" bench/bench_gpu.py --device cpu --sizes 64k --head-size tiny \
    --chunks 64k --reps 2
else
  stage bench "$BENCH_LIMIT" "$OUT/bench.txt" "$PY" bench/bench_gpu.py
fi
grep -v -i "warning\|output = op" "$OUT/bench.txt"

echo "== summary ($OUT/summary.txt): $FAILED stage(s) did not pass"
cat "$OUT/summary.txt"
exit "$FAILED"
