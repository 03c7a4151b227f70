"""What `--budget auto` costs per round on the GPU: the composed IF-node round and the host-choice fallback,
forced to each bucket, against the fixed-budget round of that size, all as graph replays in one run.

    python3 benchmarks/budget_auto_rounds.py --out DIR        # on the H200 (the demo pair, bf16, batch 1)

Each round is timed as autotune times it (runtime/decode/autotune.py: the session frozen, REPLAYS replays
between CUDA events, the fastest of REPS): fixed(b), a fixed-budget session's captured round at budget b;
auto(b), the auto:B_MAX session's composed round with the choice forced to b (its head builds the tree
at B_MAX and computes the choice, then one IF node runs); host(b), the same pieces launched by the host
reading the bucket (HostChoiceRound: one sync per round, the fallback).  Writes DIR/budget-auto-rounds.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import print_table, write_result  # noqa: E402
from runtime.decode.autotune import REPLAYS, REPS  # noqa: E402
from runtime.decode.clock import time_launches  # noqa: E402
from runtime.decode.conditional import HostChoiceRound  # noqa: E402

B_MAX = 256


def session_of(eng):
    """The batch-1 decode session an engine's last generation used."""
    return eng.runner._sessions[(*eng.spec_config.key, 1)]


def time_forced(session, launch, index: int | None) -> float:
    """µs per replay, the fastest of REPS timings, with the auto choice forced to bucket `index` (None: a
    fixed session, nothing to force)."""
    best = float("inf")
    with session.frozen():
        if index is not None:
            session.choice.force.fill_(index)
        for rep in range(REPS + 1):
            us = time_launches(launch, REPLAYS)
            if rep:
                best = min(best, us)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", type=Path, default=ROOT / "artifacts" / "demo-pair")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    from runtime.engine.engine import Engine
    dtype = getattr(torch, args.dtype)
    eng = Engine.load(args.pair / "target", device="cuda", drafter=args.pair / "drafter", spec="ddtree", budget=16,
                      dtype=dtype)
    prompt = "import os\n\n\ndef main():\n"
    auto = eng.configure(spec="ddtree", budget=f"auto:{B_MAX}")
    list(auto.generate_ids(prompt, 8))
    s_auto = session_of(auto)
    if True not in s_auto.graphs:
        raise SystemExit(f"the auto session has no graph: {auto.last_stats.get('graph_note')}")
    composed = s_auto.graphs[True]
    head, bodies = composed.pieces[0], composed.pieces[1:]
    host = HostChoiceRound(head, bodies, s_auto.choice.pick, "measured beside the IF nodes")
    rows = []
    for i, b in enumerate(s_auto.choice.buckets):
        fixed = eng.configure(spec="ddtree", budget=b)
        list(fixed.generate_ids(prompt, 8))
        s_fixed = session_of(fixed)
        f_us = time_forced(s_fixed, s_fixed.graphs[True].launch, None)
        a_us = time_forced(s_auto, composed.launch, i)
        h_us = time_forced(s_auto, host.launch, i)
        rows.append({"budget": b, "fixed_us": round(f_us, 2), "auto_if_us": round(a_us, 2),
                     "auto_host_us": round(h_us, 2), "if_overhead_us": round(a_us - f_us, 2),
                     "host_over_if_us": round(h_us - a_us, 2)})
    none_us = time_forced(s_auto, composed.launch, len(s_auto.choice.buckets))
    print_table(rows, ["budget", "fixed_us", "auto_if_us", "auto_host_us", "if_overhead_us", "host_over_if_us"])
    print(f"auto head alone (draft, tree_build at {B_MAX}, choice; no bucket): {none_us:.1f} µs")
    write_result("budget-auto-rounds", rows,
                 {"shapes": {"model": str(args.pair), "dtype": args.dtype, "batch": 1, "b_max": B_MAX},
                  "auto_head_only_us": round(none_us, 2), "graph_via": composed.via,
                  "method": "graph replays, session frozen, fastest of REPS timings of REPLAYS replays "
                            "(runtime/decode/autotune.py)"}, args.out)

if __name__ == "__main__":
    main()
