#!/usr/bin/env bash
# The wgmma MoE's kernel forms side by side in one device call (plugins/moe_w4a16/NOTES.md, "gate_up's tokens by
# TMA"): rs (register A, launch_wgmma's default kernels), xt (gate_up's tokens gathered by kdtree_moe_wg_gather_x and
# brought by TMA: KDTREE_MOE_XT=1; down stays rs).  First the quick GPU test of every form, then each expert-GEMM
# kernel alone under ncu (benchmarks/moe_v3_ncu.sh: TP8 tree routing, the wgmma kernels at every t).
# Usage (device tool): [FORMS="rs xt"] bash benchmarks/moe_wgmma_forms.sh [t ...]   (default: both forms; 1 64 512)
# Prints a table (form, kernel, t, µs, DRAM MB, TB/s) and keeps it as $OUT/moe_wgmma_forms.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
ts="${*:-1 64 512}"
out=${OUT:-/tmp}/moe_wgmma_forms.txt
KDTREE_GPU_QUICK=1 KDTREE_RESULTS_DIR=${OUT:-/tmp} timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider \
  -k "$(echo ${FORMS:-rs xt} | sed 's/ / or /g')" tests/test_moe_wgmma_gpu.py 2>&1 | tail -2 > "$out"
printf "%-4s %-24s %6s %10s %10s %8s\n" form kernel t us dram_MB TB/s >> "$out"
for form in ${FORMS:-rs xt}; do
  xt=0
  [[ $form == xt ]] && xt=1
  WGMMA=1 KDTREE_MOE_XT=$xt timeout 200 bash benchmarks/moe_v3_ncu.sh $ts 2>&1 \
    | grep -E "^ ?kdtree_moe_(wg|xt)_|gpu__time_duration|dram__bytes_read" \
    | awk -v form="$form" -v ts="$ts" '
        BEGIN { n = split(ts, t, " "); i = 0 }
        /kdtree_moe_(wg|xt)_/ { k = $1; if (k ~ /gather_x/ || (k ~ /gate_up/ && form != "xt")) i++; want = 1; next }
        want && /dram__bytes_read/ { mb = $NF; gsub(",", "", mb) }
        want && /gpu__time_duration/ {
          us = $NF; gsub(",", "", us)
          printf "%-4s %-24s %6s %10.1f %10.1f %8.2f\n", form, k, t[i], us, mb, (us > 0 ? mb / us : 0)
          want = 0 }' >> "$out"
done
cat "$out"
