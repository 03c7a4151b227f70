#!/usr/bin/env bash
# One device call for dense_gemm: the GPU tests, then the side-by-side benchmark (cuBLAS vs the Triton skinny
# GEMM), a short table last.  `sweep A|B` instead times every config candidate at t in {1, 17, 65} for half of
# the shapes (each half its own call: ~100-170 Triton compiles of ~1.5 s, then the timings).
# Usage (device tool): bash benchmarks/dense_gemm_device.sh [sweep A|B]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kdtree-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ ${1:-} == sweep ]]; then
  half=${2:-A}
  shapes=qkv_a,q_b,o_proj; [[ $half == B ]] && shapes=lm_head,shared_down,router_gate_up
  timeout ${SWEEP_TIMEOUT:-540} python3 benchmarks/dense_gemm.py --sweep --t ${SWEEP_T:-1,17,65} --shapes $shapes \
    --tag $half --out "$OUT" > "$OUT/dense_gemm_sweep.log" 2>&1
  echo "sweep exit $?"
  tail -n 40 "$OUT/dense_gemm_sweep.log"
  exit 0
fi
timeout ${TEST_TIMEOUT:-270} python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_dense_gemm.py 2>&1 | tail -8
timeout ${BENCH_TIMEOUT:-280} python3 benchmarks/dense_gemm.py --out "$OUT" > "$OUT/dense_gemm.log" 2>&1
echo "benchmark exit $?"
grep -v "^wrote" "$OUT/dense_gemm.log" | tail -n 50
