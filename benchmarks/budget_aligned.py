"""The acceptance half of "budget buckets of 2^k - 1 nodes": tau at budget 2^k - 1 against 2^k on the trained demo
pair (CPU, fp32, reference path, batch 1, T = 0, held-out prompts; artifacts/demo-pair).

A tree of B nodes is verified as N = B + 1 tokens.  At B = 2^k, N = 2^k + 1 pads every power-of-two tile of the
verify (the attention's 64-row blocks at h = 8, skinny_gemm's 8-token tiles, cuBLAS's tiles); at B = 2^k - 1 it
fills them.  Dropping the tree's last node (the least likely of a best-first tree) costs the acceptance measured
here; the cost half, T(2^k) against T(2^k + 1), is `benchmarks/k26_switches.py --budget 15,16` on the GPU.
Every run's tokens must equal AR's.  Writes OUT/budget-aligned.json; prints a table.

    .venv/bin/python benchmarks/budget_aligned.py [--ks 2,3,4,5,6] [--prompts 8] [--new 96] [--out DIR]   # ~7 min
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.budget_auto_pair import PAIR, run  # noqa: E402
from benchmarks.common import RESULTS_DIR, print_table  # noqa: E402
from core.provenance import git_commit  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", default="2,3,4,5,6", help="k of the pairs (2^k - 1, 2^k)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new", type=int, default=96, help="new tokens per prompt")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = ap.parse_args()
    from runtime.engine.engine import Engine
    from training.measure import heldout_prompts

    t0 = time.time()
    prompts = heldout_prompts(PAIR / "corpus", args.prompts)
    eng = Engine.load(PAIR / "target", device="cpu", drafter=PAIR / "drafter", spec="ddtree", budget=16,
                      dtype=torch.float32)
    ar = run(eng, prompts, args.new, 0.0, None, None)["outs"]
    rows, failed = [], []
    for k in (int(v) for v in args.ks.split(",")):
        row = {"k": k}
        for name, b in (("aligned", 2 ** k - 1), ("power", 2 ** k)):
            r = run(eng, prompts, args.new, 0.0, b, None)
            rounds = sum(r["histogram"].values())
            row[f"{name}_budget"], row[f"{name}_tokens_verified"] = b, b + 1
            row[f"{name}_tau"], row[f"{name}_rounds"] = round(r["tokens"] / rounds, 4), rounds
            if r["outs"] != ar:
                failed.append(f"budget {b}")
        row["tau_ratio"] = round(row["aligned_tau"] / row["power_tau"], 4)
        rows.append(row)
        print(row, flush=True)
    eng.close()
    doc = {"benchmark": "budget-aligned", "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "git_commit": git_commit(), "device": f"cpu ({platform.processor() or platform.machine()})",
           "torch": torch.__version__, "model": "artifacts/demo-pair (target + trained DFlash drafter), fp32, CPU "
                                                "reference path, batch 1, T = 0",
           "prompts": len(prompts), "new_tokens": args.new, "rows": rows, "matches_ar": not failed,
           "seconds": round(time.time() - t0, 1),
           "notes": ["acceptance only: the verify's cost at N = 2^k against 2^k + 1 tokens is measured on the GPU "
                     "(benchmarks/k26_switches.py --budget 15,16)"]}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "budget-aligned.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print_table(rows, ["k", "aligned_budget", "aligned_tau", "power_budget", "power_tau", "tau_ratio"])
    print(f"wrote {path} ({doc['seconds']} s)")
    if failed:
        sys.exit(f"budget_aligned: tokens differ from AR at T = 0 (fp32): {', '.join(failed)}")


if __name__ == "__main__":
    main()
