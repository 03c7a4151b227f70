#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, then every benchmark; results into $OUT/results.tgz.
# Usage (device tool): bash benchmarks/device_run.sh [tests|bench|all] [pytest -k expr]
# Env: TESTS="tests/x.py ..." limits the GPU tests; PARALLEL=1 runs each file in its own process, side by side
# (with KDTREE_GPU_QUICK=1: a fifth of the random cases, every file in one call); BENCH="tree_verify_mla ..." picks
# benchmarks; QUICK=1 passes --quick.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kdtree-out}
mkdir -p "$OUT/res"
export KDTREE_RESULTS_DIR="$OUT/res" NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
what=${1:-all}
kexpr=${2:-}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv,noheader | tee "$OUT/res/nvidia-smi.txt"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/res/pip.log" 2>&1 || echo "pip install -e . failed (see pip.log)"
status=0
# results.tgz is refreshed after every step, so a run cut short still brings back what it finished
pack() { tar -czf "$OUT/results.tgz.tmp" -C "$OUT" res && mv "$OUT/results.tgz.tmp" "$OUT/results.tgz"; }
if [[ $what == tests || $what == all ]]; then
  # TESTS="tests/a.py tests/b.py" limits the run to those files
  if [[ -n ${PARALLEL:-} ]]; then  # one pytest process per file, side by side (tests/run_gpu_parallel.sh)
    LOGS="$OUT/res" FILE_TIMEOUT_S=${TEST_TIMEOUT:-400} bash tests/run_gpu_parallel.sh ${TESTS:-}
    status=$?
  else
    timeout ${TEST_TIMEOUT:-400} python3 -m pytest -q -m gpu -rs -p no:cacheprovider ${TESTS:-} ${kexpr:+-k "$kexpr"} \
      2>&1 | tee "$OUT/res/pytest-gpu.log" | tail -40
    status=${PIPESTATUS[0]}
  fi
  pack
fi
if [[ $what == bench || $what == all ]]; then
  # an entry is NAME or NAME:ARG,ARG (e.g. tree_verify_mla:--no-sweep); QUICK=1 adds --quick to plain names
  for entry in ${BENCH:-tree_verify_mla tree_build tree_accept kv_commit moe_w4a16 skinny_gemm allreduce}; do
    b=${entry%%:*}; args=""; [[ $entry == *:* ]] && args=${entry#*:} && args=${args//,/ }
    [[ -z $args && -n ${QUICK:-} ]] && args="--quick"
    [[ -f benchmarks/$b.py ]] || continue
    left=$(( ${BUDGET_S:-560} - SECONDS ))
    if (( left < 30 )); then echo "=== $b skipped: ${left}s left of BUDGET_S"; continue; fi
    echo "=== $b"
    log="$OUT/res/bench-$b${args:+-${args//[^a-z]/}}.log"  # one log per entry (the same benchmark may run twice)
    timeout $(( left < 240 ? left : 240 )) python3 benchmarks/$b.py --out "$OUT/res" $args >"$log" 2>&1
    echo "rc=$?"; tail -25 "$log"
    pack
  done
fi
pack && rm -rf "$OUT/res"
exit $status
