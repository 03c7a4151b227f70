#!/usr/bin/env bash
# Nsight Compute stall breakdown of tree_verify_mla's split kernels on one DDTree shape (h 8, b 1): the wgmma kernel
# (tree_verify_wgmma.cu) and the Triton table's, one call each: where the warps wait, instructions, bytes, duration.
# Usage (device tool): bash benchmarks/tree_verify_ncu.sh [N L]   (default 17 32768)
# SASS=1: also the wgmma kernel's SASS hotspots (warp-stall samples per instruction, benchmarks/ncu_sass_hotspots.py);
# KERNELS=regex limits the metrics to those kernels (default: every tree_verify kernel of the two calls);
# TRITON_ONLY=1 runs the table's Triton kernels only (shapes the wgmma kernel does not take: N 1, the AR step);
# SASS_KERNELS=regex picks the kernels of the SASS hotspots (default: the wgmma one)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
n=${1:-17}
l=${2:-32768}
cat > /tmp/tv_calls.py <<PY
import sys, torch
from benchmarks.tree_verify_mla import Case
from plugins.tree_verify_mla.launcher import WGMMA_CONFIG
c = Case(1, 8, int(sys.argv[1]), int(sys.argv[2]), 1)
for cfg in ((None,) if int(sys.argv[3]) else (WGMMA_CONFIG, None)):
    c.check_variant(cfg, None, False) if cfg else c.check()
torch.cuda.synchronize()
PY
stalls=$(for s in long_scoreboard short_scoreboard math_pipe_throttle wait barrier mio_throttle lg_throttle not_selected selected dispatch_stall no_instruction membar sleeping branch_resolving drain misc; do printf "smsp__average_warps_issue_stalled_%s_per_issue_active.ratio," $s; done)
timeout 300 ncu --clock-control none -k regex:"${KERNELS:-tree_verify}" \
  --metrics ${stalls}gpu__time_duration.sum,dram__bytes_read.sum,lts__t_bytes.sum,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum \
  python3 /tmp/tv_calls.py "$n" "$l" "${TRITON_ONLY:-0}" 2>&1 | grep -E "tree_verify|stalled|duration|bytes|inst_executed|warps_active|issue_active|gmma|conflicts" \
  | sed -E 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//; s/ +/ /g'
if [[ -n ${SASS:-} ]]; then
  csv=${OUT:-/tmp}/ncu-sass.csv
  timeout 240 ncu --clock-control none -k regex:"${SASS_KERNELS:-tree_verify_wgmma}" --section SourceCounters --section WarpStateStats \
    --page source --print-source sass --csv python3 /tmp/tv_calls.py "$n" "$l" "${TRITON_ONLY:-0}" >"$csv" 2>"$csv.err" \
    || tail -5 "$csv.err"
  python3 benchmarks/ncu_sass_hotspots.py "$csv" --top 30
fi
