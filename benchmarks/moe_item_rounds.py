"""Does the MoE's gate_up at a DDTree round's token count pay for the items' rounds over its CTAs?

gate_up (plugins/moe_w4a16/moe_v3.cu) gives each CTA every gridDim.x-th item (item = an expert's token tile x a row
pair of 32 rows; 16 row pairs an expert at K2.6 TP8), on 2 x SMs 8-warp CTAs.  With E entries there are 16 E items,
so ceil(16 E / 264) rounds on an H100 while the average CTA does 16 E / 264: at E = 34 sixteen CTAs take a third item
while the rest are done.  This benchmark routes t tokens (17 by default: a DDTree-16 round; top 8) onto exactly E
experts, each getting at most 8 slots (one token tile: E entries), for E across the round boundaries, and times
gate_up and down alone (torch profiler, PDL off so a kernel's time is its own), beside the bytes each must read at the
device's copy rate.
If the rounds bind, gate_up's time steps up where ceil(16 E / CTAs) does (E = 34, 50, 67 on 132 SMs) and is flat
between; if the bytes bind, it grows with E throughout.  (A stream-K gate_up that split the (item, chunk) sequence
evenly over the CTAs was slower at every E: git show 0e56ab8:benchmarks/results/moe-item-rounds.json.)

    KDTREE_PDL=0 python3 benchmarks/moe_item_rounds.py [--tokens T] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import kernel_us, print_table, write_result  # noqa: E402
from benchmarks.moe_w4a16 import SCALING, D, E, K  # noqa: E402
from benchmarks.moe_w4a16_v3 import make_experts  # noqa: E402
from plugins.common.device import copy_bytes_per_s, device_facts  # noqa: E402
from plugins.moe_w4a16 import MoEWorkspace, moe_w4a16  # noqa: E402
from plugins.moe_w4a16 import launch_v3  # noqa: E402

ENTRIES = (16, 17, 24, 33, 34, 40, 49, 50, 66, 67, 100)  # around the round boundaries on 264 CTAs (16 items an entry)


def entry_counts(t: int) -> list[int]:
    """The E to time for t tokens: ENTRIES that t K slots fill with at most 8 slots an expert, and at least K (each
    token's K experts distinct), plus the fewest that can (t K / 8)."""
    fewest = max(K, -(-t * K // 8))
    return sorted({fewest, *(n for n in ENTRIES if fewest <= n <= t * K)})


def routed_logits(t: int, entries: int, dev) -> torch.Tensor:
    """logits [t, E] whose top K of each token are K distinct experts of a pool of `entries` (slot s = token * K + j
    goes to pool[s % entries]): every pool expert gets ceil or floor of t K / entries slots, at most 8 for
    entries >= t K / 8, so each is one token tile."""
    pool = torch.randperm(E, generator=torch.Generator().manual_seed(entries))[:entries]
    logits = torch.full((t, E), -8.0)
    for s in range(t * K):
        logits[s // K, pool[s % entries]] = 8.0 + 0.01 * (s % K)  # distinct, well above the rest
    return logits.to(dev)


def prefix_us(per_kernel: dict[str, float], prefix: str) -> float:
    """µs of the kernels (common.kernel_us's {name: µs}) whose names start with prefix."""
    return sum(us for name, us in per_kernel.items() if name.startswith(prefix))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=17, help="tokens a call (17: a DDTree-16 round, 9: DDTree-8)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if os.environ.get("KDTREE_PDL", "1") != "0":
        sys.exit("moe_item_rounds: run with KDTREE_PDL=0 (each kernel's time its own, not its wait)")
    dev = torch.device("cuda")
    sms, rate = device_facts(dev).sms, copy_bytes_per_s(dev)
    ex = make_experts(E, 256, dev)
    w13, s13, w2, s2 = ex["frag"]
    gate_up_bytes = (w13[0].numel() * 4 + s13[0].numel() * 2)  # one expert's gate_up weights and scales
    down_bytes = (w2[0].numel() * 4 + s2[0].numel() * 2)
    pairs = w13.shape[1]
    t = a.tokens
    x = torch.randn(t, D, device=dev).to(torch.bfloat16)
    bias = torch.zeros(E, device=dev)
    ws = MoEWorkspace.allocate(t, K, E, D, 256, x.dtype, dev)
    ctas = launch_v3.GATE_UP_CTAS_PER_SM[1] * sms
    rows = []
    for n in entry_counts(t):
        logits = routed_logits(t, n, dev)
        def call():
            return moe_w4a16(x, logits, None, bias, *ex["frag"], K, 1, 1, True, SCALING, 0, ws.buffer)  # noqa: B023

        per = kernel_us(call)
        g, d = prefix_us(per, "kdtree_moe_v3_gate_up"), prefix_us(per, "kdtree_moe_v3_down")
        items = n * pairs
        g_roof, d_roof = n * gate_up_bytes / rate * 1e6, n * down_bytes / rate * 1e6
        rows.append({"entries": n, "items": items, "gate_up_ctas": ctas, "rounds": -(-items // ctas),
                     "items_per_cta": round(items / ctas, 2), "gate_up_us": round(g, 2),
                     "gate_up_roofline_us": round(g_roof, 2), "gate_up_fraction": round(g_roof / g, 3),
                     "gate_up_us_per_round": round(g / -(-items // ctas), 2), "down_us": round(d, 2),
                     "down_roofline_us": round(d_roof, 2), "down_fraction": round(d_roof / d, 3)})
        print(rows[-1], flush=True)
    extra = {"tokens": t, "top_k": K, "experts": E, "d": D, "i": 256, "copy_bytes_per_s": rate, "sms": sms,
             "timing": "torch profiler, eager, KDTREE_PDL=0: each kernel's own device time, mean of 20 calls",
             "routing": f"t = {t} tokens onto exactly `entries` experts, at most 8 slots each (one token tile)"}
    path = write_result("moe-item-rounds", rows, extra, a.out)
    print(f"wrote {path}")
    print_table(rows, ["entries", "items", "rounds", "items_per_cta", "gate_up_us", "gate_up_roofline_us",
                       "gate_up_fraction", "gate_up_us_per_round", "down_us", "down_fraction"])


if __name__ == "__main__":
    main()
