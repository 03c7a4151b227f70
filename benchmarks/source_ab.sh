#!/usr/bin/env bash
# A kernel source change measured against its base in one device call ("rerun the baseline in the same call"):
# runs CMD with SOURCE replaced by BASE (another version of the file, e.g. `git show REV:SOURCE > base.cu` carried
# as an untracked file), then with SOURCE as it is, output under $OUT/base and $OUT/new ($OUT set for each run).
# The cubin cache is keyed by the source's sha (plugins/common/cubin.py), so each run compiles / loads its own.
#   bash benchmarks/source_ab.sh SOURCE BASE CMD...      e.g.
#   bash benchmarks/source_ab.sh plugins/moe_w4a16/moe_v3.cu moe_v3_base.cu python3 benchmarks/moe_w4a16_v3.py --quick
set -uo pipefail
cd "$(dirname "$0")/.."
src=$1 base=$2
shift 2
[[ -f $src && -f $base ]] || { echo "source_ab: $src or $base not found" >&2; exit 2; }
root=${OUT:-/tmp/kdtree-out}
keep=$(mktemp)
cp "$src" "$keep"
trap 'cp "$keep" "$src"; rm -f "$keep"' EXIT
status=0
for side in base new; do
  [[ $side == base ]] && cp "$base" "$src" || cp "$keep" "$src"
  mkdir -p "$root/$side"
  echo "=== $side ($(sha256sum "$src" | cut -c1-12))"
  OUT=$root/$side "$@" || status=1
done
exit $status
