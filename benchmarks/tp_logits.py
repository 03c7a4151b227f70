"""Vocab-parallel lm_head at T = 0: all-gather the logits then argmax, vs a distributed argmax.

    python3 benchmarks/tp_logits.py [--quick] [--out DIR] [--tp 2,4] [--device cpu|cuda]

Each rank holds logits [n, v/tp] of its vocabulary slice (Kimi's v = 163840; n = tree nodes).
  gather : all_gather the [n, v/tp] pieces -> [n, v] on every rank, argmax        (runtime TargetModel.logits)
  argmax : local (max, index) -> all_gather [n, 2] per rank -> pick the best rank (TargetModel.greedy)
Also the speculative-control question (runtime/model/target.py): broadcasting rank 0's round results
(tokens, parents, accept_idx, accept_len, bonus: 5 small tensors) vs each rank computing them.
CPU: gloo over loopback, one thread per rank; CUDA: NCCL, world = the visible GPUs.  Writes
benchmarks/results/tp_logits_{gloo,nccl}.json (or --out DIR) and prints a table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from runtime.parallel.comm import Comm  # noqa: E402
from runtime.parallel.ranks import launch  # noqa: E402

VOCAB = 163840


def _time_us(fn, sync, reps: int) -> float:
    for _ in range(max(3, reps // 10)):
        fn()
    sync()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def _worker(comm: Comm, sizes: list[int], vocab: int, reps: int) -> list[dict]:
    dev = comm.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    g = torch.Generator(device="cpu").manual_seed(comm.rank)
    rows = []
    v_l = vocab // comm.world
    start = comm.rank * v_l
    for n in sizes:
        local = torch.randn(n, v_l, generator=g).to(dev)  # [n, v/tp] fp32

        def gather():
            return comm.all_gather(local, dim=-1).argmax(dim=-1)  # [n]

        def dist_argmax():
            best, idx = local.max(dim=-1)  # [n]
            pair = torch.stack([best.double(), (idx + start).double()], dim=-1)  # [n, 2]
            every = comm.all_gather(pair[None], dim=0)  # [world, n, 2]
            r = every[..., 0].argmax(dim=0, keepdim=True)
            return every[..., 1].gather(0, r)[0].long()

        assert torch.equal(gather(), dist_argmax())
        comm.barrier()
        t_gather = _time_us(gather, sync, reps)
        comm.barrier()
        t_argmax = _time_us(dist_argmax, sync, reps)
        # control broadcast: tokens/parents [1, n] + accept_idx [1, 9] + accept_len/bonus [1]
        ctrl = [torch.zeros(1, n, dtype=torch.int64, device=dev), torch.zeros(1, n, dtype=torch.int32, device=dev),
                torch.zeros(1, 9, dtype=torch.int32, device=dev), torch.zeros(1, dtype=torch.int32, device=dev),
                torch.zeros(1, dtype=torch.int64, device=dev)]
        comm.barrier()
        t_bcast = _time_us(lambda: [comm.broadcast(t) for t in ctrl], sync, reps)
        rows.append({"tp": comm.world, "n": n, "vocab": vocab, "gather_us": t_gather, "argmax_us": t_argmax,
                     "gather_bytes_per_rank": n * vocab * 4, "argmax_bytes_per_rank": n * 16 * comm.world,
                     "control_broadcast_us": t_bcast})
    return rows


def _control_compute_us(n: int, reps: int) -> float:
    """tree_accept + kv_commit-sized work a rank redoes instead of receiving a broadcast (reference ops)."""
    from plugins.tree_accept import tree_accept
    post = torch.randint(0, 1024, (1, n))
    tokens = torch.randint(0, 1024, (1, n))
    parents = torch.arange(-1, n - 1, dtype=torch.int32)[None]
    idx, ln = torch.zeros(1, 9, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    bonus = torch.zeros(1, dtype=torch.long)
    return _time_us(lambda: tree_accept(post, tokens, parents, idx, ln, bonus), lambda: None, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--tp", default=None, help="world sizes, e.g. 2,4 (default: 2,4 on CPU; the GPUs on CUDA)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    os.environ.setdefault("KDTREE_RANK_THREADS", "1")
    if a.tp:
        worlds = [int(x) for x in a.tp.split(",")]
    else:
        worlds = [torch.cuda.device_count()] if a.device == "cuda" else [2, 4]
    sizes = [1, 17, 65] if a.quick else [1, 9, 17, 33, 65, 129]
    reps = 20 if a.quick else 50
    rows = []
    for w in worlds:
        rows += launch(_worker, w, (sizes, VOCAB, reps), device=a.device)[0]
    ctrl = {n: _control_compute_us(n, reps) for n in sizes}
    for r in rows:
        r["control_recompute_us"] = ctrl[r["n"]]
        r["argmax_speedup"] = r["gather_us"] / r["argmax_us"]
    from benchmarks.common import print_table, write_result
    backend = "nccl" if a.device == "cuda" else "gloo"
    path = write_result(f"tp_logits_{backend}", rows, {"device": a.device, "backend": backend,
                                                       "timing": "host wall clock, median, per call on rank 0"}, a.out)
    print(f"wrote {path}")
    print_table(rows, ["tp", "n", "gather_us", "argmax_us", "argmax_speedup", "control_broadcast_us",
                       "control_recompute_us"])


if __name__ == "__main__":
    main()
