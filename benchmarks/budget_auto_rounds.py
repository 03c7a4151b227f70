"""What `--budget auto` costs per round on the GPU: the composed round (a SWITCH node; IF nodes beside it as the
peer) and the host-choice fallback, forced to each bucket, with the full tree built and with the tree capped at
that bucket, against the fixed-budget round of that size, all as graph replays in one run.

    python3 benchmarks/budget_auto_rounds.py [--from-budget 8] --out DIR    # on the H200 (the demo pair, bf16, batch 1)

Each round is timed as autotune times it (runtime/decode/autotune.py: the session frozen, REPLAYS replays
between CUDA events, the fastest of REPS): fixed(b), a fixed-budget session's captured round at budget b;
auto(b), the auto:B_MAX session's composed round with the tree built at B_MAX and the choice forced to b
(its head drafts, builds and chooses, then the conditional node runs one body; auto_full_if the same composed
with one IF node per bucket); capped(b), the same with the tree built at b
(b a cap: runtime/decode/budget.py), so capped(b) - fixed(b) is what auto adds besides tree_build;
head(b), the capped head alone (no bucket); host(b), the full-tree pieces launched by the host reading
the bucket (HostChoiceRound: one sync per round, the fallback).  Writes DIR/budget-auto-rounds.json.
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
from core.cache_dir import cache_root  # noqa: E402
from plugins.common.device import device_facts  # noqa: E402
from plugins.graph_conditional import setter_cubin  # noqa: E402
from runtime.decode.conditional import ConditionalRound, HostChoiceRound  # noqa: E402

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
    ap.add_argument("--from-budget", type=int, default=1, help="compare the buckets from this one up")
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
    choice = s_auto.choice
    nb, full = len(choice.buckets), len(choice.buckets) - 1
    heads = dict(zip(choice.caps, composed.pieces[:len(choice.caps)]))
    bodies = composed.pieces[len(choice.caps):]
    host = HostChoiceRound(heads, bodies, choice.pick, "measured beside the conditional node")
    cubin, _ = setter_cubin(device_facts(s_auto.target.device).arch, cache_root())
    if_form = ConditionalRound(heads, bodies, choice.hot, cubin, "auto-if", form="if")  # the peer: IF nodes
    rows = []
    for i, b in enumerate(choice.buckets):
        if b < args.from_budget:
            continue
        fixed = eng.configure(spec="ddtree", budget=b)
        list(fixed.generate_ids(prompt, 8))
        s_fixed = session_of(fixed)
        f_us = time_forced(s_fixed, s_fixed.graphs[True].launch, None)
        a_us = time_forced(s_auto, lambda: composed.launch(full), i)
        h_us = time_forced(s_auto, lambda: host.launch(full), i)
        if_us = time_forced(s_auto, lambda: if_form.launch(full), i)
        row = {"budget": b, "fixed_us": round(f_us, 2), "auto_full_us": round(a_us, 2), "auto_host_us": round(h_us, 2),
               "auto_full_if_us": round(if_us, 2), "full_over_fixed_us": round(a_us - f_us, 2),
               "host_over_composed_us": round(h_us - a_us, 2), "if_over_composed_us": round(if_us - a_us, 2)}
        if i in choice.caps:
            c_us = time_forced(s_auto, lambda: composed.launch(i), i)
            c_if_us = time_forced(s_auto, lambda: if_form.launch(i), i)
            head_us = time_forced(s_auto, lambda: composed.launch(i), nb)
            row.update(auto_capped_us=round(c_us, 2), capped_over_fixed_us=round(c_us - f_us, 2),
                       capped_if_over_fixed_us=round(c_if_us - f_us, 2), head_us=round(head_us, 2))
        rows.append(row)
    print_table(rows, ["budget", "fixed_us", "auto_full_us", "auto_capped_us", "head_us", "auto_host_us",
                       "full_over_fixed_us", "capped_over_fixed_us", "capped_if_over_fixed_us", "host_over_composed_us",
                       "if_over_composed_us"])
    write_result("budget-auto-rounds", rows,
                 {"shapes": {"model": str(args.pair), "dtype": args.dtype, "batch": 1, "b_max": B_MAX},
                  "caps": [choice.buckets[j] for j in choice.caps], "graph_via": composed.via,
                  "curve": choice.curve.to_dict() if choice.curve else None,
                  "method": "graph replays, session frozen, fastest of REPS timings of REPLAYS replays "
                            "(runtime/decode/autotune.py)"}, args.out)


if __name__ == "__main__":
    main()
