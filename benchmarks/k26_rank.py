"""One TP8 rank of Kimi K2.6 at its true size on one H200 (`kdtree bench kimi-k2.6 --rank-only`).

Runs runtime/bench_rank.run_rank_bench (full depth: 61 layers drawn in GPU memory) and writes
OUT/k26-rank.json; `--plot JSON` draws k26-rank.png from it on any machine (matplotlib): T(N) against
its roofline at each cache length, the whole round next to it, and the modelled TP8 tokens/s.

    python3 benchmarks/k26_rank.py --out benchmarks/results          # on the GPU (~5 min)
    python3 benchmarks/k26_rank.py --plot benchmarks/results/k26-rank.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def plot(json_path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.loads(json_path.read_text())
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    ax = axes[0]
    for ctx in sorted({r["context"] for r in res["rows"]}):
        rows = [r for r in res["rows"] if r["context"] == ctx]
        n = [r["tokens"] for r in rows]
        line = ax.plot(n, [r["verify_us"] for r in rows], "o-", label=f"T(N) measured, L={ctx}")[0]
        ax.plot(n, [r["verify_roofline_us"] for r in rows], "--", color=line.get_color(),
                label=f"T(N) roofline (bytes or flops a class), L={ctx}")
        ax.plot(n, [r["step_us"] for r in rows], "s:", color=line.get_color(), alpha=0.6,
                label=f"whole round (AR step at N=1), L={ctx}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens verified N (= budget + 1)")
    ax.set_ylabel("µs per forward, one TP8 rank")
    ax.set_title(f"K2.6 TP8 rank {res['rank']}, {res['layers']} layers, {res['gpu']}")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    ax = axes[1]
    curves = res["collectives_model"]["curves"]
    lat = res["collectives_model"]["allreduce_us_assumed"][0]
    for ctx in sorted({c["context"] for c in curves}):
        for c in curves:
            if c["context"] != ctx or c["allreduce_us"] != lat or c["mode"] not in ("ar", "ddtree-16", "ddtree-64"):
                continue
            taus = [float(t) for t in c["tokens_per_s"]]
            ax.plot(taus, list(c["tokens_per_s"].values()), "o-" if c["mode"] != "ar" else "k*",
                    label=f"{c['mode']}, L={ctx}")
    ax.set_xlabel("tau (accepted tokens per round)")
    ax.set_ylabel("tokens/s per user (modelled TP8)")
    ax.set_title(f"measured rank time + 2x{res['layers']} all-reduces at {lat} µs (assumed)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out = json_path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--source", default="kimi-k2.6", help="preset or synthetic artifact")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--budgets", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--plot", type=Path, default=None, help="only draw the PNG of this JSON")
    args = ap.parse_args()
    if args.plot is not None:
        print(f"wrote {plot(args.plot)}")
        return
    from runtime.bench_rank import format_rank_table, run_rank_bench, write_rank_result

    res = run_rank_bench(args.source, layers=args.layers, contexts=tuple(int(c) for c in args.contexts.split(",")),
                         budgets=tuple(int(b) for b in args.budgets.split(",")), iters=args.iters)
    path = write_rank_result(res, args.out)
    print(format_rank_table(res))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
