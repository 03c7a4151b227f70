"""Issue 16's whole-round figures: kernels per layer per round and GPU µs per round, fused layer glue
(plugins/layer_fusion) against the unfused torch ops, and the fused kernels with and without programmatic
dependent launch (KDTREE_PDL, plugins/common/pdl.py), measured in one run.

Each (model, mode) runs runtime/bench_rank.run_rank_bench in its own process (KDTREE_FUSION and KDTREE_PDL
are read at import): the AR step and the DDTree-16 round captured in CUDA graphs, replay time, and a
profiler count of the kernels of one replay by class.  Models: the tiny Kimi preset (4 layers, the
shape of the CPU tests) and one TP8 rank of K2.6 (61 layers, drawn in GPU memory).

    python3 benchmarks/layer_fusion.py --out benchmarks/results            # on the GPU (~4 min)
    python3 benchmarks/layer_fusion.py --models tiny-kimi --out /tmp/x     # the tiny model only
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODELS = {"tiny-kimi": dict(tp=1, contexts=(512,)), "kimi-k2.6": dict(tp=8, contexts=(4096,))}
BUDGET = 16


def _child(model: str, out: Path) -> None:
    """In the subprocess: one run_rank_bench, its rows and profiles as JSON on `out`."""
    from runtime.bench_rank import run_rank_bench
    spec = MODELS[model]
    res = run_rank_bench(model, tp=spec["tp"], contexts=spec["contexts"], budgets=(BUDGET,), iters=50,
                         profile_budget=BUDGET, progress=False)
    keep = ("context", "mode", "tokens", "step_us", "verify_us", "verify_roofline_us", "drafter_us", "tree_build_us",
            "tree_accept_us", "kv_commit_us")
    out.write_text(json.dumps({"layers": res["layers"], "gpu": res["gpu"], "git_commit": res["git_commit"],
                               "rows": [{k: r[k] for k in keep if k in r} for r in res["rows"]],
                               "profiles": res["profiles"]}))


def run(models: list[str], tmp: Path) -> dict:
    res: dict = {"benchmark": "layer-fusion", "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                 "budget": BUDGET, "models": {}}
    for model in models:
        per = {}
        for mode, fusion, pdl in (("unfused", "0", "0"), ("fused-nopdl", "1", "0"), ("fused", "1", "1")):
            path = tmp / f"{model}-{mode}.json"
            env = dict(os.environ, KDTREE_FUSION=fusion, KDTREE_PDL=pdl, PYTHONPATH=str(ROOT))
            proc = subprocess.run([sys.executable, __file__, "--child", model, "--child-out", str(path)], env=env,
                                  capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                raise RuntimeError(f"{model} {mode} failed:\n{proc.stderr[-3000:]}")
            per[mode] = json.loads(path.read_text())
            print(f"{model} {mode}: done", flush=True)
        res["gpu"], res["git_commit"] = per["fused"]["gpu"], per["fused"]["git_commit"]
        res["models"][model] = {"layers": per["fused"]["layers"], "context": MODELS[model]["contexts"][0], **{
            mode: {"rows": d["rows"],
                   "kernels_per_layer": {m: p["kernels_per_layer"] for m, p in d["profiles"].items()},
                   "kernels": {m: p["kernels"] for m, p in d["profiles"].items()},
                   "profile_gpu_us": {m: p["gpu_us"] for m, p in d["profiles"].items()},
                   "classes": {m: p["classes"] for m, p in d["profiles"].items()},
                   "top": {m: p["top"] for m, p in d["profiles"].items()}}
            for mode, d in per.items()}}
    return res


def table(res: dict) -> str:
    lines = [f"{'model':10} {'round':10} {'kern/layer':>16} {'step us: unfused -> no PDL -> fused':>36} "
             f"{'verify us':>18} {'speedup':>8}"]
    for model, m in res["models"].items():
        un, npd, fu = m["unfused"], m["fused-nopdl"], m["fused"]
        for ru, rn, rf in zip(un["rows"], npd["rows"], fu["rows"]):
            mode = ru["mode"]
            kl = f"{un['kernels_per_layer'].get(mode, '-')} -> {fu['kernels_per_layer'].get(mode, '-')}"
            lines.append(f"{model:10} {mode:10} {kl:>16} {ru['step_us']:>10.0f} -> {rn['step_us']:>7.0f} -> "
                         f"{rf['step_us']:<10.0f} {ru['verify_us']:>8.0f} -> {rf['verify_us']:<7.0f} "
                         f"{ru['step_us'] / rf['step_us']:>7.2f}x")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child, args.child_out)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        res = run([m for m in args.models.split(",") if m], Path(tmp))
    path = args.out / "layer-fusion.json"
    path.write_text(json.dumps(res, indent=1))
    print(table(res))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
