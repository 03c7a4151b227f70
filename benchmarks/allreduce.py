"""NCCL all_reduce latency for the TP layer outputs: [n x 7168] bf16, n = tree nodes (+ root).

    python3 benchmarks/allreduce.py [--quick] [--out DIR]

World size = the visible GPUs (1 GPU: world 1, which measures NCCL's launch floor and the graph
path, not the wire).  Per n: eager (CUDA events around one call, median) and inside a CUDA graph of
20 back-to-back all-reduces (the way a captured round issues 2 per layer x 61 layers), per call.
Roofline: a ring all-reduce moves 2 (w-1)/w x bytes per rank over NVLink (H200: ~450 GB/s per
direction); at w = 1 nothing moves, so the floor is 0 and only the latency is reported.
Writes benchmarks/results/allreduce.json (or --out DIR).  Rank 0 prints the table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from runtime.parallel.comm import Comm  # noqa: E402
from runtime.parallel.ranks import launch  # noqa: E402

HIDDEN = 7168
SIZES = (1, 9, 17, 33, 65, 129, 257)
NVLINK_BYTES_PER_S = 450e9
PER_GRAPH = 20


def _events_us(fn, reps: int) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) * 1e3)
    return statistics.median(samples)


def _worker(comm: Comm, sizes: list[int], reps: int) -> list[dict]:
    dev = comm.device
    rows = []
    for n in sizes:
        x = torch.randn(n, HIDDEN, device=dev).to(torch.bfloat16)
        comm.all_reduce(x)
        torch.cuda.synchronize()
        comm.barrier()
        eager = _events_us(lambda: comm.all_reduce(x), reps)
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
            for _ in range(PER_GRAPH):
                comm.all_reduce(x)
        torch.cuda.synchronize()
        comm.barrier()
        graphed = _events_us(g.replay, reps) / PER_GRAPH
        w = comm.world
        nbytes = n * HIDDEN * 2
        floor = 2 * (w - 1) / w * nbytes / NVLINK_BYTES_PER_S * 1e6
        rows.append({"world": w, "n": n, "shape": f"[{n}, {HIDDEN}] bf16", "bytes": nbytes, "eager_us": eager,
                     "graph_us_per_call": graphed, "us": graphed, "roofline_us": floor,
                     "roofline_fraction": floor / graphed if graphed > 0 else None,
                     "per_round_61_layers_us": 2 * 61 * graphed})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("allreduce: needs CUDA GPUs (NCCL); nothing measured")
        return
    world = torch.cuda.device_count()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on the lent machines
    reps = 50 if a.quick else 200
    rows = launch(_worker, world, (list(SIZES), reps), device="cuda")[0]
    from benchmarks.common import print_table, write_result
    path = write_result("allreduce", rows, {"world": world, "peers": "torch.distributed NCCL all_reduce (eager, "
                                            "and per call inside a CUDA graph of 20)",
                                            "note": "custom one-shot all-reduce: a later option "
                                            "(runtime/parallel/comm.py)"},
                        a.out)
    print(f"wrote {path}")
    print_table(rows, ["world", "n", "bytes", "eager_us", "graph_us_per_call", "roofline_us",
                       "per_round_61_layers_us"])


if __name__ == "__main__":
    main()
