#!/usr/bin/env bash
# `--budget auto` on the H200 in one device call (issue 15): the GPU tests (IF-node round, forced buckets,
# the host-choice fallback, the session's own curve), the per-round cost of auto against fixed budgets
# (benchmarks/budget_auto_rounds.py), then the demo pair's real drafter with graphs: fixed budgets against
# auto:256, bf16 at T = 0 and 1.
#   bash benchmarks/budget_auto_device.sh      (device tool; JSON under $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kdtree-out}; PAIR=${PAIR:-artifacts/demo-pair}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 KDTREE_RESULTS_DIR="$OUT"
common=(--target "$PAIR/target" --drafter "$PAIR/drafter" --corpus "$PAIR/corpus" --device cuda --no-chain)
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "=== GPU tests"
  timeout 200 python3 -m pytest -q -m gpu tests/test_budget_auto_gpu.py 2>&1 | tail -4
fi
echo "=== round cost: fixed, auto (IF nodes), auto (host reads the bucket)"
timeout 150 python3 benchmarks/budget_auto_rounds.py --pair "$PAIR" --out "$OUT" 2>&1 | grep -v Warning | tail -14
echo "=== bf16, T=0 and 1: fixed budgets against auto:256"
timeout 300 python3 benchmarks/demo_pair.py "${common[@]}" --dtype bfloat16 --budgets ${BUDGETS:-1,2,4,8,16,32,64,128,256} \
  --auto 256 --out "$OUT/auto-bf16.json" 2>&1 | grep -v Warning | grep -v "^ddtree\|^mode " | tail -24
