#!/usr/bin/env bash
# The demo pair's training on the GPU machine, one phase per device call (each fits its 10-minute limit):
#   bash benchmarks/train_demo_device.sh target DATA    # trains + exports the target -> $OUT/target-part-*
#   bash benchmarks/train_demo_device.sh drafter DATA   # DATA also holds target/ + target-report.json
# DATA: what training/pipeline.py made on the CPU machine (corpus/ with manifest + eval shard, tokenizer/,
# tokens-{train,eval}.npy), so that the corpus is this repo's CPython 3.11 stdlib, not the device's 3.12.
# The phase's outputs come back as one tarball split into 15 MiB parts (the device tool's file limits).
set -euo pipefail
cd "$(dirname "$0")/.."
phase=$1 data=$2
OUT=${OUT:-/tmp/kdtree-out}
work=/tmp/demo-pair
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
mkdir -p "$work" "$OUT" && cp -r "$data"/. "$work"/
args=(--out "$work" --device cuda --steps "${STEPS:-4500}" --drafter-steps "${DRAFTER_STEPS:-3000}"
      --ckpt-every 1000 --eval-every 250 --no-measure)
if [[ $phase == target ]]; then
  python3 scripts/train_demo.py "${args[@]}" --stop-after target 2>&1 | tr '\r' '\n' | grep -v '^ *$' | tail -8
  files=(target target-report.json loss.jsonl)
else
  python3 scripts/train_demo.py "${args[@]}" 2>&1 | tr '\r' '\n' | grep -v '^ *$' | tail -30
  files=(drafter report.json loss.jsonl loss.png)
fi
tar -czf "$OUT/$phase.tgz" -C "$work" "${files[@]}"
split -b 15m -d "$OUT/$phase.tgz" "$OUT/$phase-part-" && rm "$OUT/$phase.tgz"
ls -la "$OUT"
