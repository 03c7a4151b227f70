#!/usr/bin/env bash
# One device call (< 600 s) that decides the runtime's performance switches: the GPU tests of the kernels behind
# them, then the K2.6 rank's AR step and DDTree rounds under each switch setting (one load,
# benchmarks/k26_switches.py), then the quick kernel benchmarks of the MoE and the few-token GEMM with what is left.
#   bash benchmarks/ab_device.sh [all|tests|switches]   (device tool, repo root as cwd; results under $OUT)
# k26_switches takes ~15 s per setting after a ~10 s load (H200, 2026-12-05): `all` fits the five default settings;
# `tests` (tests + kernel benchmarks) and `switches` (every setting) can also go in two calls back to back.
# Env: BUDGET_S (default 585) for the whole call; TEST_FILES (the GPU test files); BENCH (device_run.sh's);
# SETTINGS / BUDGETS / LAYERS / CONTEXT / PROFILE (1: --profile) passed to k26_switches; SOURCE=tiny-kimi times the tiny
# model's step instead (tp 1, context 512: issue 16's figure).
set -uo pipefail
cd "$(dirname "$0")/.."
R=${OUT:-/tmp/kdtree-out}
mkdir -p "$R"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
budget=${BUDGET_S:-585}
what=${1:-all}
status=0
if [[ $what != switches ]]; then
  echo "=== GPU tests of the switched kernels"
  files="tests/test_skinny_gemm.py tests/test_moe_v3_gpu.py tests/test_tree_verify_mla_kernel.py"
  files=${TEST_FILES:-$files tests/test_l2_prefetch.py tests/test_layer_fusion.py}
  OUT=$R/tests PARALLEL=1 KDTREE_GPU_QUICK=1 TEST_TIMEOUT=${TEST_TIMEOUT:-170} TESTS="$files" \
    bash benchmarks/device_run.sh tests >"$R/tests.log" 2>&1 || status=1
  tail -15 "$R/tests.log"
fi
# default = skinny+moe_early+skinny_early+glue_early+moe_w16 (2026-12-06); the previous default (8-warp gate_up, the
# glue kernels' weights after the wait); without the MoE's early down; neither early switch
defaults=default,skinny+moe_early+skinny_early,skinny+skinny_early+glue_early+moe_w16,skinny
settings=${SETTINGS:-$defaults}
src=(--budget "${BUDGETS:-15,16}" --settings "$settings")
[[ ${SOURCE:-} == tiny-kimi ]] && src+=(--source tiny-kimi --tp 1 --context 512)
[[ -n ${CONTEXT:-} ]] && src+=(--context "$CONTEXT")  # the cache length (k26_switches' default 4096)
[[ -n ${LAYERS:-} ]] && src+=(--layers "$LAYERS")  # e.g. 40 on an 80 GB H100 (61 layers need the H200)
[[ ${PROFILE:-1} == 1 ]] && src+=(--profile)  # per setting: kernels per layer, each kernel class's µs in the step
if [[ $what != tests ]]; then
  echo "=== switch A/B at ${SECONDS} s"
  keep=$([[ $what == all ]] && echo 90 || echo 0)  # s kept for the kernel benchmarks
  left=$(( budget - SECONDS - keep ))
  timeout $(( left > 60 ? left : 60 )) python3 benchmarks/k26_switches.py --out "$R" "${src[@]}" >"$R/switches.log" \
    2>&1 || status=1
  tail -14 "$R/switches.log"
fi
if [[ $what != switches ]]; then
  left=$(( budget - SECONDS ))
  echo "=== kernel benchmarks, ${left} s left"
  bench=${BENCH:-moe_w4a16_v3:--quick skinny_gemm:--quick}
  OUT=$R/bench BUDGET_S=$left BENCH="$bench" bash benchmarks/device_run.sh bench \
    >"$R/bench.log" 2>&1 || status=1
  tail -40 "$R/bench.log"
fi
exit $status
