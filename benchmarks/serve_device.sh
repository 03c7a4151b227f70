#!/usr/bin/env bash
# `kdtree serve` on the H200 in one device call (< 8 min): the bounded load test with the tiny model,
# tests/test_serve.py with the servers and the engine on cuda, and the posterior kernel's GPU test.
#   bash benchmarks/serve_device.sh        (device tool, from the repo root; results into $OUT)
# The device image lacks the serving stack (fastapi, starlette, uvicorn, pydantic, openai and their
# dependencies): their wheels (the versions of the dev venv, 6.3 MB), downloaded into .whl/ (git-ignored) by
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 pydantic==2.14.4 pydantic-core==2.50.5 openai==3.60.0 \
#     annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5 typing-extensions==4.16.0 \
#     jiter==0.19.0 sniffio==1.3.1 opentelemetry-api==1.45.2 httpx2==2.16.2 httpcore2==2.16.2 \
#     truststore==0.10.5 idna==3.20 anyio==4.16.0 h11==0.16.0
# are carried at the repo root and installed into /tmp/site, which goes first on PYTHONPATH (click, httpx,
# jinja2, typer and torch come from the image).
# Env: WHL (wheel folder, default .whl), STEPS (default "load posterior serve"), BUDGET_S (default 450).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kdtree-out}; WHL=${WHL:-.whl}; SITE=/tmp/site
mkdir -p "$OUT"
if ! compgen -G "$WHL/*.whl" >/dev/null; then
  echo "error: no wheels in $WHL (download them as benchmarks/serve_device.sh's header says)"; exit 2
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHL"/*.whl \
  >"$OUT/pip.log" 2>&1 || { echo "error: installing $WHL/*.whl into $SITE failed (see pip.log)"; exit 2; }
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 KDTREE_RESULTS_DIR="$OUT"
python3 - <<'EOF' || exit 2
import importlib
names = ["fastapi", "starlette", "uvicorn", "pydantic", "openai", "httpx", "anyio", "click", "typer", "jinja2", "torch"]
got = []
for n in names:
    try:
        got.append(f"{n} {getattr(importlib.import_module(n), '__version__', '?')}")
    except Exception as exc:  # noqa: BLE001 - name the package that is missing or broken, then stop
        raise SystemExit(f"error: import {n} failed on the device: {exc}")
print("packages:", ", ".join(got))
EOF
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv,noheader \
  | tee "$OUT/nvidia-smi.txt"
budget=${BUDGET_S:-450}
declare -A rc
step() {  # step NAME SECONDS CMD...: run CMD under min(SECONDS, what is left of BUDGET_S), log to $OUT/NAME.log
  local name=$1 want=$2; shift 2
  local left=$(( budget - SECONDS ))
  if (( left < 30 )); then echo "=== $name skipped: ${left}s left of BUDGET_S"; rc[$name]=skipped; return; fi
  echo "=== $name"
  timeout $(( left < want ? left : want )) "$@" >"$OUT/$name.log" 2>&1
  rc[$name]=$?
  tail -${TAIL:-25} "$OUT/$name.log"
}
for s in ${STEPS:-load posterior serve}; do
  case $s in
    # the CPU figure's settings (benchmarks/results/serve-load-cpu.json): the tiny random checkpoint
    # (build_pipeline.tiny, as `kdtree make-tiny DIR --preset kimi` writes it), AR, 8 clients for 20 s
    load) step load 170 python3 -m benchmarks.serve_load --device cuda --out "$OUT" ;;
    serve) KDTREE_TEST_DEVICE=cuda step serve 260 python3 -m pytest -q -rs -p no:cacheprovider tests/test_serve.py ;;
    posterior) step posterior 120 python3 -m pytest -q -m gpu -rs -p no:cacheprovider \
                 tests/test_accept_commit_kernels.py -k "posterior" ;;
    *) echo "error: unknown step $s (load, serve or posterior)"; exit 2 ;;
  esac
done
echo "=== summary (${SECONDS}s)"
for s in "${!rc[@]}"; do echo "$s rc=${rc[$s]}"; done
python3 - "$OUT/serve-load-cuda.json" <<'EOF'
import json
import sys
from pathlib import Path

from benchmarks.common import print_table

path = Path(sys.argv[1])
if not path.exists():
    raise SystemExit(f"no {path.name}: the load step did not finish")
doc = json.loads(path.read_text())
print(f"{doc.get('gpu')}: {doc['clients']} clients for {doc['seconds']} s, {doc['max_tokens']} tokens each")
print_table(doc["rows"], ["setting", "max_batch", "requests", "completed", "errors", "hung", "tokens_per_s",
                          "ttft_s_mean", "latency_s_p50", "latency_s_p95", "round_ms_mean"])
print(f"batching / one at a time: {doc['speedup_tokens_per_s']}x tokens/s")
EOF
for s in "${!rc[@]}"; do [[ ${rc[$s]} == 0 ]] || exit 1; done
