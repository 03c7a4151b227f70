#!/usr/bin/env bash
# `--budget auto` on the H200 in one device call (issue 15): the demo pair's real drafter with graphs, fixed
# budgets against auto:256 (the tree capped per round) and auto:256 building the full tree every round, bf16
# at T = 0 and 1; then the per-round cost of auto against fixed budgets (benchmarks/budget_auto_rounds.py:
# full tree, capped tree, head alone, IF nodes vs host read); then the GPU tests (IF-node round, forced
# buckets, the host-choice fallback, the session's own curve).  Each step has its own timeout; the Triton
# kernels compiled by the first step are on disk for the next ones.  The three do not fit one 10-minute call
# (on 2026-12-04 the demo step ran past 230 s, the tests past 90 s): STEPS picks them, e.g. STEPS=demo in one
# call and STEPS="rounds tests" in another.
#   STEPS="demo rounds tests" bash benchmarks/budget_auto_device.sh      (device tool; JSON under $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kdtree-out}; PAIR=${PAIR:-artifacts/demo-pair}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 KDTREE_RESULTS_DIR="$OUT"
STEPS=" ${STEPS:-demo rounds tests} "
common=(--target "$PAIR/target" --drafter "$PAIR/drafter" --corpus "$PAIR/corpus" --device cuda --no-chain)
if [[ $STEPS == *" demo "* ]]; then
  echo "=== bf16, T=0 and 1: fixed budgets against auto:256 (capped) and auto:256 (full tree)"
  timeout "${T_DEMO:-420}" python3 benchmarks/demo_pair.py "${common[@]}" --dtype bfloat16 \
    --budgets "${BUDGETS:-16,32,64,128,256}" --auto 256 --out "$OUT/budget-auto-demo-pair.json" 2>&1 \
    | grep -v Warning | grep -v "^ddtree\|^mode " | tail -28
fi
if [[ $STEPS == *" rounds "* ]]; then
  echo "=== round cost: fixed, auto (full tree / capped, IF nodes), auto (host reads the bucket)"
  timeout "${T_ROUNDS:-120}" python3 benchmarks/budget_auto_rounds.py --pair "$PAIR" --from-budget 8 --out "$OUT" \
    2>&1 | grep -v Warning | tail -10
fi
if [[ $STEPS == *" tests "* ]]; then
  echo "=== GPU tests"
  timeout "${T_TESTS:-300}" python3 -m pytest -q -x -m gpu tests/test_budget_auto_gpu.py 2>&1 | tail -6
fi
