#!/usr/bin/env bash
# Nsight Compute stall breakdown of the v3 op's kernels (route, gate_up, down, combine; TP8 tree routing, one call
# per t): where the warps wait, and each kernel's duration alone (ncu serializes them: no PDL overlap).
# Usage (device tool): bash benchmarks/moe_v3_ncu.sh [t ...]
# WGMMA=1: the expert GEMMs on moe_wgmma.cu's kernels at every t (launch_wgmma.FORCE), WGMMA=0: on v3's mma.sync ones
# SASS=regex: also the source page of the first t's kernels matching regex (warp-stall samples per SASS instruction,
# benchmarks/ncu_sass_hotspots.py; the CSV kept under $OUT as ncu-sass.csv)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
ts="${*:-1 64}"
cat > /tmp/v3_calls.py <<PY
import torch, sys
from benchmarks.moe_w4a16 import E, K, SCALING, make_inputs
from benchmarks.moe_w4a16_v3 import make_experts
import os
from plugins.moe_w4a16 import launch_wgmma, moe_w4a16
launch_wgmma.FORCE = {"1": True, "0": False}.get(os.environ.get("WGMMA", ""))
dev = torch.device("cuda")
ex = make_experts(E, 256, dev)
for t in [int(a) for a in sys.argv[1:]]:
    x, logits, bias = make_inputs(t, "tree", dev, seed=t)
    moe_w4a16(x, logits, None, bias, *ex["frag"], K, 1, 1, True, SCALING, 0)
torch.cuda.synchronize()
PY
stalls=$(for s in long_scoreboard short_scoreboard math_pipe_throttle wait barrier mio_throttle lg_throttle not_selected selected dispatch_stall no_instruction tex_throttle branch_resolving drain imc_miss misc; do printf "smsp__average_warps_issue_stalled_%s_per_issue_active.ratio," $s; done)
timeout 300 ncu --clock-control none -k regex:"kdtree_moe_(v3|wg)|route_kernel|combine" \
  --metrics ${stalls}gpu__time_duration.sum,dram__bytes_read.sum,lts__t_bytes.sum,l1tex__t_bytes.sum,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active \
  python3 /tmp/v3_calls.py $ts 2>&1 | grep -E "kdtree_moe|route_kernel|combine|stalled|duration|bytes|inst_executed|warps_active|issue_active" \
  | sed -E 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//; s/ +/ /g'
if [[ -n ${SASS:-} ]]; then
  first=${ts%% *}
  csv=${OUT:-/tmp}/ncu-sass.csv
  timeout 240 ncu --clock-control none -k regex:"$SASS" --section SourceCounters --section WarpStateStats \
    --page source --print-source sass --csv python3 /tmp/v3_calls.py "$first" >"$csv" 2>"$csv.err" \
    || tail -5 "$csv.err"
  python3 benchmarks/ncu_sass_hotspots.py "$csv" --top 25
fi
