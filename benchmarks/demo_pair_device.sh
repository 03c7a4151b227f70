#!/usr/bin/env bash
# The demo pair's H200 measurements in one device call; run files into $OUT, merged here afterwards:
#   bash benchmarks/demo_pair_device.sh            (device tool; PAIR=artifacts/demo-pair)
#   python benchmarks/demo_pair.py --merge CPU.json $OUT/cuda-bf16.json $OUT/cuda-fp32.json
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kdtree-out}; PAIR=${PAIR:-artifacts/demo-pair}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
common=(--target "$PAIR/target" --drafter "$PAIR/drafter" --corpus "$PAIR/corpus" --device cuda)
echo "=== peers (fp32 identity, bf16 timing)"
timeout 240 python3 benchmarks/demo_pair_peers.py --pair "$PAIR" --out "$OUT/demo-pair-peers.json" 2>&1 \
  | grep -v Warning | tail -12
echo "=== ours fp32, T=0 (exactness)"
timeout 200 python3 benchmarks/demo_pair.py "${common[@]}" --dtype float32 --temperatures 0 \
  --out "$OUT/cuda-fp32.json" 2>&1 | grep -v Warning | tail -14
echo "=== ours bf16, T=0 and 1"
timeout 300 python3 benchmarks/demo_pair.py "${common[@]}" --out "$OUT/cuda-bf16.json" 2>&1 | grep -v Warning | tail -30
