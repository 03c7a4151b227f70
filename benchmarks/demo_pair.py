"""tau and speedup over AR of the demo pair (issue 19, "Measure"): DDTree at budgets 4..256 and the
DFlash chain, at T = 0 and T = 1, on prompts from the held-out stdlib modules.

    .venv/bin/python benchmarks/demo_pair.py --target OUT/target --drafter OUT/drafter --corpus OUT/corpus
    python benchmarks/demo_pair.py ... --device cuda          # on the H200 (kernels and graphs)

Writes benchmarks/results/demo-pair.json (or --out): one row per (temperature, mode) with tau, decode
tokens/s, speedup over AR at that temperature, and at T = 0 whether the tokens equal AR's (they must).
Runs on whatever pair it is given (CPU reference or CUDA).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.measure import divergence_margins, heldout_prompts, measure_pair

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="tau and speedup of a target + DFlash drafter pair")
    ap.add_argument("--target", required=True, type=Path)
    ap.add_argument("--drafter", required=True, type=Path)
    ap.add_argument("--corpus", type=Path, help="corpus dir of training/corpus.py (held-out prompts)")
    ap.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable; instead of --corpus)")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts to use")
    ap.add_argument("--budgets", default="4,8,16,32,64,128,256")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-chain", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "demo-pair.json")
    args = ap.parse_args(argv)
    prompts = list(args.prompt) or (heldout_prompts(args.corpus, args.prompts) if args.corpus else [])
    if not prompts:
        ap.error("give --corpus (held-out prompts) or --prompt")
    res = measure_pair(args.target, args.drafter, prompts, [int(b) for b in args.budgets.split(",")],
                       [float(t) for t in args.temperatures.split(",")], args.max_new_tokens, args.device,
                       chain=not args.no_chain)
    res["host"] = {"python": platform.python_version(), "machine": platform.machine()}
    print(f"{'T':>4} {'mode':<12} {'tau':>7} {'tok/s':>9} {'speedup':>8} {'==AR':>5}")
    for r in res["runs"]:
        print(f"{r['temperature']:>4} {r['mode']:<12} {r['tau'] or 0:>7.3f} {r['decode_tokens_per_s'] or 0:>9.1f} "
              f"{r.get('speedup_vs_ar') or 1.0:>8.3f} {r.get('identical_to_ar', '')!s:>5}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {args.out}")
    bad = [r["mode"] for r in res["runs"] if r.get("identical_to_ar") is False]
    if bad:
        # where each run left AR's tokens: the target's fp64 CPU logits there for both tokens
        res["divergences"] = divergence_margins(args.target, prompts, res["ids_t0"])
        args.out.write_text(json.dumps(res, indent=2) + "\n")
        print(f"{'mode':<12} {'prompt':>6} {'pos':>4} {'fp64 logit AR tok':>18} {'run tok':>8} {'top2 gap':>9}")
        for d in res["divergences"]:
            print(f"{d['mode']:<12} {d['prompt']:>6} {d['position']:>4} {d['logit_ar_token']:>18.4f} "
                  f"{d['logit_run_token']:>8.4f} {d['top2_gap']:>9.4f}")
        print(f"NOT LOSSLESS at T=0: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
