#!/usr/bin/env bash
# One device call for moe_w4a16 v3: GPU tests, the per-launch profile, the side-by-side benchmark.
# Usage (device tool): bash benchmarks/moe_v3_device.sh [quick]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kdtree-out}
mkdir -p "$OUT"
export KDTREE_RESULTS_DIR="$OUT" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu -x -p no:cacheprovider ${TESTS:-tests/test_moe_v3_gpu.py} 2>&1 | tail -8
timeout 150 python3 benchmarks/moe_w4a16_v3.py --profile ${PROFILE_T:-1,16,64,512} 2>&1 | grep "^t="
args=""; [[ ${1:-} == quick ]] && args="--quick"
timeout ${BENCH_TIMEOUT:-240} python3 benchmarks/moe_w4a16_v3.py --out "$OUT" $args 2>&1 | tail -22
