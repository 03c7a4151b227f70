#!/usr/bin/env bash
# One device call for dense_gemm: the GPU tests, then the side-by-side benchmark (cuBLAS vs the Triton skinny
# GEMM), a short table last.  `sweep` instead times every config candidate at t in {1, 17, 65} (its own call:
# up to ~8 min of Triton compiles and timings).
# Usage (device tool): bash benchmarks/dense_gemm_device.sh [sweep]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kdtree-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ ${1:-} == sweep ]]; then
  timeout ${SWEEP_TIMEOUT:-540} python3 benchmarks/dense_gemm.py --sweep --t ${SWEEP_T:-1,17,65} --out "$OUT" \
    > "$OUT/dense_gemm_sweep.log" 2>&1
  echo "sweep exit $?"
  tail -n 40 "$OUT/dense_gemm_sweep.log"
  exit 0
fi
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_dense_gemm.py 2>&1 | tail -8
timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/dense_gemm.py --out "$OUT" > "$OUT/dense_gemm.log" 2>&1
echo "benchmark exit $?"
grep -v "^wrote" "$OUT/dense_gemm.log" | tail -n 50
