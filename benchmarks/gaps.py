"""Goals against the measured results: one row per goal of the GPU-kernel issues, read from the committed
benchmarks/results/<op>.json files (no GPU needed), with the reason found and the next step where a goal is not
met (from plugins/<op>/NOTES.md, where the measurements behind each reason are).

    python3 benchmarks/gaps.py [--results DIR] [--json]     # table; writes DIR/gaps.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

RESULTS = Path(__file__).resolve().parent / "results"

Row = dict[str, Any]


def _mla(h: int, n: int, l_len: int) -> Callable[[Row], bool]:
    return lambda r: (r["b"], r["h"], r["N"], r["L"]) == (1, h, n, l_len)


def _moe(t: int) -> Callable[[Row], bool]:
    return lambda r: r["shape"] == f"k26_tp8_t{t}" and r["routing"] == "tree"


# (op, shape label, row selector, goal kind, goal value, reason, next step); op names the results file
# (benchmarks/results/<op>.json), whose rows hold the figures in COLUMNS[op] (default: us, roofline_fraction)
#   goal kind "fraction": roofline_fraction >= value; "us": us <= value; "bandwidth": roofline_fraction >= value
MLA_MEM = ("launch pair + split-KV combine fixed cost (N = 1); at N = 4-8 the kernel is issue-bound on 16-64-row "
           "score tiles, not bandwidth-bound")
MLA_MEM_NEXT = ("33-1024 rows run tree_verify_wgmma.cu (two warpgroups on 64 rows x 512 columns, ~3.3 us a 64-key "
                "tile against ~1.2 tensor-bound, every phase in series at 2 warps a scheduler); next: a producer warp "
                "and consumers on separate row blocks, which needs Q's shared memory halved or 32-key stages")
MLA_CMP = ("tree_verify_wgmma.cu (58 % at h8 N64 L32K, H100): the 36 score wgmmas' issue and the P / rescale phase "
           "in series with the value wgmmas (plugins/tree_verify_mla/NOTES.md, ncu)")
MOE = ("four dependent launches (route, gate_up, down, combine: 4.3 + 11.5 + 6.9 + 3.1 us a layer at t = 1 in the "
       "H100 round, 5.0 + 33.7 + 16.7 + 3.1 at t = 17); gate_up ~74 SASS instructions per 512-byte k group at issue "
       "~50 % (ncu, t = 17), so more bytes in flight did not pay (plugins/moe_w4a16/NOTES.md, the shared-memory ring)")
MOE_NEXT = ("fewer launches: the combine into down (the routing inside gate_up lost: every CTA repeating its serial "
            "picks cost more than the launch, NOTES.md 2026-12-05); fewer instructions per weight byte other than the "
            "dequant's shifts (bf16 needs a source per nibble pair, NOTES.md 2026-12-06); on the H100 by its own "
            "copy rate v3 is at 0.27 / 0.57 / 0.49 / 0.54 / 0.33 (t = 1 / 9 / 17 / 64 / 512, moe_w4a16_v3-h100.json)")
COLUMNS = {"moe_w4a16_v3": ("v3_us", "v3_fraction")}  # the runtime's kernel among the benchmark's peers
GOALS = [
    *[("tree_verify_mla", f"h8 N{n} L{l_len // 1024}K", _mla(8, n, l_len), "fraction", 0.8, MLA_MEM, MLA_MEM_NEXT)
      for l_len in (32768, 131072) for n in (1, 2, 4, 8)],
    ("tree_verify_mla", "h64 N64 L32K", _mla(64, 64, 32768), "fraction", 0.6, MLA_CMP, MLA_MEM_NEXT),
    ("tree_build", "B256 D8 b1 V163840", lambda r: (r["B"], r["D"], r["b"]) == (256, 8, 1), "us", 20.0,
     "per depth a chain of CTA-wide barrier steps (histogram passes, cumsums, scatters), plus stage 1's launches",
     "warp-level depth steps on registers (shuffles only) or a persistent multi-CTA design; fewer stage-1 launches"),
    ("tree_accept", "B256 b1", lambda r: (r["B"], r["b"]) == (256, 1), "us", 5.0, "", ""),
    ("tree_accept", "B256 b64", lambda r: (r["B"], r["b"]) == (256, 64), "us", 5.0, "", ""),
    *[("kv_commit", f"61 layers + feats, b{b} L{l_len}",
       (lambda bb, ll: lambda r: (r["b"], r["L"]) == (bb, ll))(b, l_len), "bandwidth", 0.8,
       "two dependent launches (~3 us in a graph) dominate below ~10 MB moved",
       "one-launch variant with a last-program ticket (saves ~1 us)") for b, l_len in ((1, 8), (8, 8), (64, 8))],
    # issue 17: >= 50 % at t = 1, 8, 16, 64 and >= 60 % at 256, 512 (the --quick rows: t = 9 and 17 for 8 and 16)
    *[("moe_w4a16_v3", f"TP8 tree t={t}", _moe(t), "fraction", 0.5 if t <= 64 else 0.6, MOE, MOE_NEXT)
      for t in (1, 9, 17, 64, 512)],
]


def evaluate(results: Path) -> list[Row]:
    docs: dict[str, dict] = {}
    out = []
    for op, label, pick, kind, goal, reason, nxt in GOALS:
        if op not in docs:
            path = results / f"{op}.json"
            if not path.is_file():
                raise FileNotFoundError(f"gaps: {path} missing (run benchmarks/{op}.py on the GPU first)")
            docs[op] = json.loads(path.read_text())
        rows = [r for r in docs[op]["rows"] if pick(r)]
        if not rows:
            out.append({"op": op, "shape": label, "goal": f"{kind} {goal}", "measured": None, "met": None,
                        "reason": "no such row in the results", "next_step": f"rerun benchmarks/{op}.py"})
            continue
        us_key, frac_key = COLUMNS.get(op, ("us", "roofline_fraction"))
        r = {"us": rows[0][us_key], "roofline_fraction": rows[0].get(frac_key)}
        value = r["us"] if kind == "us" else r["roofline_fraction"]
        met = value <= goal if kind == "us" else value >= goal
        out.append({"op": op, "shape": label, "goal": f"<= {goal} us" if kind == "us" else f">= {goal:.0%} of roofline",
                    "us": r["us"], "roofline_fraction": r.get("roofline_fraction"), "met": met,
                    "reason": "" if met else reason, "next_step": "" if met else nxt,
                    "measured_on": docs[op].get("date"), "gpu": docs[op].get("gpu")})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(RESULTS), help="folder of the <op>.json results (default: committed)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = ap.parse_args(argv)
    try:
        rows = evaluate(Path(args.results))
    except (FileNotFoundError, KeyError, json.JSONDecodeError) as e:
        print(f"gaps: {e}", file=sys.stderr)
        return 1
    out = Path(args.results) / "gaps.json"
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"goals": rows}, indent=1) + "\n")
    tmp.replace(out)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    for r in rows:
        frac = f"{r['roofline_fraction']:.1%}" if r.get("roofline_fraction") is not None else "-"
        us = f"{r['us']:.4g}" if r.get("us") is not None else "-"
        print(f"{r['op']:<16}{r['shape']:<30}{r['goal']:<22}{us:>8} us {frac:>7}  "
              f"{'met' if r['met'] else 'NOT met' if r['met'] is not None else '?'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
