"""tau and speedup over AR of the demo pair (issue 19, "Measure"): DDTree at budgets 4..256 and the
DFlash chain, at T = 0 and T = 1, on prompts from the held-out stdlib modules.

    .venv/bin/python benchmarks/demo_pair.py        # artifacts/demo-pair (or --target/--drafter/--corpus)
    python benchmarks/demo_pair.py ... --device cuda          # on the H200 (kernels and graphs)

Writes --out: one row per (temperature, mode) with tau, decode tokens/s, speedup over AR at that
temperature, and at T = 0 whether the tokens equal AR's.  In fp32 / fp64 they must (exit 1 otherwise).
In bf16 the tree's batched forward rounds differently from AR's one-token forward, so a near-tie (in the
logits, or in a layer's expert routing) may resolve the other way: the run reports where each stream
left AR's, with the target's fp64 logits there, and does not fail.  `--merge A.json B.json ...` joins
runs (CPU reference, H200 bf16, H200 fp32) into benchmarks/results/demo-pair.json and its plot.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from core.provenance import git_commit  # noqa: E402
from training.measure import divergence_margins, heldout_prompts, measure_pair  # noqa: E402

DTYPES = ("float32", "float64", "bfloat16")  # torch dtype names, as kdtree run's --dtype

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="tau and speedup of a target + DFlash drafter pair")
    ap.add_argument("--target", type=Path, default=ROOT / "artifacts" / "demo-pair" / "target")
    ap.add_argument("--drafter", type=Path, default=ROOT / "artifacts" / "demo-pair" / "drafter")
    ap.add_argument("--corpus", type=Path, default=ROOT / "artifacts" / "demo-pair" / "corpus",
                    help="corpus dir of training/corpus.py (held-out prompts)")
    ap.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable; instead of --corpus)")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts to use")
    ap.add_argument("--budgets", default="4,8,16,32,64,128,256")
    ap.add_argument("--auto", type=int, default=None, metavar="B",
                    help="also run --budget auto:B (the bucket chosen per round, up to B nodes), and auto:B "
                         "building the full tree every round (ddtree-auto-full)")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, choices=DTYPES, help="default: fp32 on CPU, bf16 on CUDA")
    ap.add_argument("--no-chain", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "demo-pair.json")
    ap.add_argument("--merge", nargs="+", type=Path, help="join these run files into --out (+ a PNG plot)")
    args = ap.parse_args(argv)
    if args.merge:
        merge(args.merge, args.out)
        return 0
    prompts = list(args.prompt) or (heldout_prompts(args.corpus, args.prompts) if args.corpus else [])
    if not prompts:
        ap.error("give --corpus (held-out prompts) or --prompt")
    res = measure_pair(args.target, args.drafter, prompts, [int(b) for b in args.budgets.split(",")],
                       [float(t) for t in args.temperatures.split(",")], args.max_new_tokens, args.device,
                       chain=not args.no_chain, dtype=getattr(torch, args.dtype) if args.dtype else None,
                       auto=args.auto)
    res["host"] = {"python": platform.python_version(), "machine": platform.machine()}
    res.update(date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), git_commit=git_commit(),
               gpu=torch.cuda.get_device_name() if args.device == "cuda" else None)
    print(f"{'T':>4} {'mode':<12} {'tau':>7} {'tok/s':>9} {'speedup':>8} {'==AR':>5}")
    for r in res["runs"]:
        print(f"{r['temperature']:>4} {r['mode']:<12} {r['tau'] or 0:>7.3f} {r['decode_tokens_per_s'] or 0:>9.1f} "
              f"{r.get('speedup_vs_ar') or 1.0:>8.3f} {r.get('identical_to_ar', '')!s:>5}"
              + (f"  mean bucket {r['mean_budget']} {r['budget_histogram']} mean tree {r['mean_cap']}"
                 if "mean_budget" in r else "")
              + (f"  [{r['graph_note']}]" if r.get("graph_note") else ""))
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
        if res["dtype"] == "bfloat16":
            print(f"bf16: T=0 streams left AR's in {bad} (near-ties above; exactness is checked in fp32)")
            return 0
        print(f"NOT LOSSLESS at T=0: {bad}", file=sys.stderr)
        return 1
    return 0


def merge(paths: list[Path], out: Path) -> None:
    """One document of several runs (each keyed device/dtype) and a plot of tau and speedup per budget."""
    import datetime

    from benchmarks.common import git_commit
    runs = []
    for p in paths:
        doc = json.loads(p.read_text())
        doc.pop("ids_t0", None)
        runs.append(doc)
    merged = {"benchmark": "demo-pair", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "git_commit": git_commit(), "runs": runs}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(merged, indent=1) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for doc in runs:
        for temp in sorted({r["temperature"] for r in doc["runs"]}):
            rows = [r for r in doc["runs"] if r["temperature"] == temp and isinstance(r["budget"], int)]
            if not rows:
                continue
            label = f"{doc['device']} {doc.get('dtype', '')} T={temp:g}"
            xs = [r["budget"] for r in rows]
            axes[0].plot(xs, [r["tau"] for r in rows], "o-", label=label)
            axes[1].plot(xs, [r["speedup_vs_ar"] for r in rows], "o-", label=label)
    for ax, name in zip(axes, ("tau (tokens per round)", "speedup over AR")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("DDTree budget (nodes)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[0].legend(fontsize=7)
    fig.suptitle("demo pair: DDTree on held-out stdlib prompts")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    raise SystemExit(main())
