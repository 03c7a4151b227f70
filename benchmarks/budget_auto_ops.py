"""How many device operations `--budget auto` adds to a round: the choice (BucketChoice.select, full and capped
rounds) and the calibration (BucketChoice.observe), counted as the aten ops they dispatch (each a kernel
on CUDA, views aside) at the demo pair's shapes (batch 1, B_MAX 256, 9 buckets, 8 accept slots).

    python3 benchmarks/budget_auto_ops.py        # CPU, seconds

budget-auto-rounds.json measures what auto adds to a round on the H200 (103-128 µs with the tree capped);
these counts say how many kernels that is.  Writes benchmarks/results/budget-auto-ops.json.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks.common import RESULTS_DIR, print_table, write_result  # noqa: E402
from runtime.decode.budget import BucketChoice, CostCurve, default_buckets  # noqa: E402

B_MAX, A = 256, 8
VIEWS = {"view", "slice", "select", "unsqueeze", "t", "expand", "alias", "_unsafe_view", "as_strided", "detach",
         "lift_fresh"}  # no kernel


class OpCount(TorchDispatchMode):
    """The aten ops dispatched inside, by name."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = ap.parse_args()
    buckets = default_buckets(B_MAX)
    nb = len(buckets)
    choice = BucketChoice(buckets, "cpu")
    choice.set_curve(CostCurve(buckets, tuple(float(i) for i in range(nb)), 100.0, "counting",
                               tuple(100.0 + i for i in range(nb))))
    scores = -torch.rand(1, B_MAX + 1)  # [b, N]
    live = torch.ones(1, dtype=torch.int32)
    accept_len = torch.tensor([3], dtype=torch.int32)
    accept_idx = torch.tensor([[0, 1, 2] + [0] * (A - 3)], dtype=torch.int32)  # [b, a]
    pieces = [("select, full round (cap scoring, hint)", lambda: choice.select(scores, live)),
              ("select, capped round", lambda: choice.select(scores, live, choice.caps[0])),
              ("observe", lambda: choice.observe(accept_len, accept_idx, buckets[choice.caps[0]]))]
    rows = []
    for name, fn in pieces:
        with OpCount() as c:
            fn()
        ops = [o for o in c.ops if o not in VIEWS]
        rows.append({"piece": name, "ops": len(ops), "by_name": dict(sorted(Counter(ops).items()))})
    print_table(rows, ["piece", "ops"])
    write_result("budget-auto-ops", rows, {"shapes": {"b": 1, "b_max": B_MAX, "buckets": nb, "a": A},
                                           "device": "cpu (aten ops dispatched; on CUDA each is a kernel)",
                                           "not_counted": "the capped head's 5 copies of its tree into the round "
                                                          "buffers (round.draft_tree), the budget column fill "
                                                          "and, in full rounds, the hint copy (1 each)"},
                 args.out)


if __name__ == "__main__":
    main()
