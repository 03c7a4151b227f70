"""What a kernel boundary costs by itself on this GPU: the floor under the K2.6 rank's ~3.3 µs a boundary.

The K2.6 TP8 rank's AR step spends ~85 µs a layer over ~15 kernels against ~36 µs of bytes (H100, 40 layers,
results/k26-rank-h100.json).  Whether fewer boundaries (one persistent kernel a layer, grid barriers between its
phases) can close that depends on what a boundary costs with nothing else in the way.  This times, in one CUDA graph
each (benchmarks/cuda/boundary_cost.cu):

  plain      K dependent launches, no programmatic dependent launch (PDL)
  pdl_late   K launches with PDL, each kernel waiting for its predecessor before reading its weights
  pdl_early  K launches with PDL, each kernel reading its weights before the wait (as the runtime's early kernels do)
  barrier    one cooperative launch of K phases with a grid-wide barrier between them (a persistent kernel)
  rows_early as pdl_early, with skinny_gemm.cu's one-token read pattern (16-row groups, 64 bytes a row per block of
             32 columns, warps interleaved over the blocks) at qkv_a's and o_proj's shapes and launch plans

at weights a kernel of 0 B (the boundary alone), 1 MiB (an absorption's), 4.7 MB (q_b), 14.7 MB (o_proj) and
30.3 MB (qkv_a), one CTA of 512 threads an SM; each kernel's weights distinct, K x bytes >= 256 MiB where memory
allows (cycled through more than five L2s: from HBM).  Per row: µs a kernel, the bytes' time at this GPU's measured
copy rate (plugins/common/device.copy_bytes_per_s), the fraction, and the fixed cost = µs - bytes' time.

Prediction (H100, written before the first run): plain ~2.0 µs a kernel at 0 B, PDL ~1.0, the barrier ~0.6;
pdl_early at 14.7 MB ~5.5 µs (90 % of the copy rate), 30.3 MB ~10.8 µs.  If the barrier saves under ~0.5 µs a
boundary against pdl_early, a persistent per-layer kernel cannot close the rank's gap by itself: the cost is inside
the kernels (ramp, tail, dependent latencies), not in the boundary.

Measured (2026-12-06, results/boundary-cost.json H200, boundary-cost-h100.json H100; plugins/skinny_gemm/NOTES.md
"What a boundary costs"): PDL 0.87 / 0.97 µs at 0 B, the barrier 1.90 / 2.00, and the early-weight chains stream at
the copy rate.  Read them with the kernels' footprint in mind: the stream kernel holds 32 registers a thread, so four
of its CTAs fit an SM and the next kernels' CTAs issue their weights beside the running one; the rows kernel holds 96
(one 16-warp CTA an SM at qkv_a's plan), the runtime's skinny_gemm 128.

    python3 benchmarks/boundary_cost.py [--out DIR] [--quick]
Writes OUT/boundary-cost.json; prints the table.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import print_table, write_result  # noqa: E402

SOURCE = Path(__file__).resolve().parent / "cuda" / "boundary_cost.cu"
SIZES = {"none": 0, "1MiB": 1 << 20, "q_b": 4718592, "o_proj": 14680064, "qkv_a": 30277632}
MODES = ("plain", "pdl_late", "pdl_early", "barrier", "rows_early")
# rows_early: skinny_gemm.cu's one-token weight reads alone (kdtree_bench_rows) at its plan for the shape (n, k, warps:
# plugins/skinny_gemm/launch.split_shape, one k split), PDL, early weights: the GEMM's access pattern at the same bytes
ROWS_SHAPES = {"o_proj": (7168, 1024, 4), "qkv_a": (2112, 7168, 16)}
MAX_CTAS = 1024  # the rows mode's grid: one CTA a 16-row group
THREADS = 512
POOL_BYTES = 320 << 20  # the weights every chain cycles through
CYCLE_BYTES = 256 << 20  # at least this much distinct weights a graph (more than five 50 MB L2s)


def chain_length(nbytes: int) -> int:
    """K: kernels (or phases) a graph: 64, more for small weights (up to 256) so that a graph reads CYCLE_BYTES."""
    return 64 if nbytes == 0 else min(256, max(64, -(-CYCLE_BYTES // nbytes)))


class Bench:
    def __init__(self, device):
        import torch
        from cuda.bindings import driver as cu

        from plugins.common.cubin import load_module
        from plugins.common.device import copy_bytes_per_s, device_facts
        from plugins.common.driver import checked

        self.torch, self.cu, self.device = torch, cu, device
        self.sms = device_facts(device).sms
        self.rate = copy_bytes_per_s(device)
        module, self.where = load_module(SOURCE, device, "boundary_cost")
        self.funcs = {n: checked(cu, cu.cuModuleGetFunction(module, n.encode()), f"boundary_cost: {n}")
                      for n in ("kdtree_bench_stream", "kdtree_bench_phases", "kdtree_bench_rows")}
        self.pool = torch.empty(POOL_BYTES // 16, 4, dtype=torch.int32, device=device).random_()  # [words, 16 B]
        self.bufs = torch.zeros(2, MAX_CTAS, dtype=torch.float32, device=device)  # [ping / pong, CTA]
        self.bar = torch.zeros(2, dtype=torch.int32, device=device)  # grid barrier: arrived, generation

    def _launch(self, name: str, args: tuple, types: tuple, pdl: bool, cooperative: bool = False,
                grid: int | None = None, threads: int = THREADS) -> None:
        """One launch onto torch's current stream (plugins/common/driver.launch); a refused PDL attribute is an error
        here, not a plain launch, so that no row is timed as what it is not."""
        from plugins.common.driver import launch
        stream = self.cu.CUstream(self.torch.cuda.current_stream().cuda_stream)
        went_pdl = launch(self.cu, self.funcs[name], grid or self.sms, threads, 0, stream, args, types, pdl,
                          f"boundary_cost: launch {name}", self.device.index, cooperative=cooperative)
        if pdl and not went_pdl:
            raise RuntimeError(f"boundary_cost: launch {name}: the driver refused programmatic dependent launch")

    def _record(self, mode: str, nbytes: int, k: int) -> None:
        """The K kernels (or one launch of K phases) of a mode, onto torch's current stream."""
        words = max(nbytes // 16, 0)
        n_bufs = max(1, min(k, POOL_BYTES // max(nbytes, 1)))
        base = self.pool.data_ptr()
        u64, i32, u32, ptr = ctypes.c_uint64, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p
        if mode == "barrier":
            self._launch("kdtree_bench_phases", (base, words, n_bufs, self.bufs[0].data_ptr(), self.bufs[1].data_ptr(),
                                                 self.bar.data_ptr(), k),
                         (ptr, u64, u32, ptr, ptr, ptr, i32), pdl=False, cooperative=True)
            return
        for j in range(k):
            w = base + (j % n_bufs) * words * 16
            if mode == "rows_early":
                n, kk, warps = ROWS_SHAPES[next(s for s, b in SIZES.items() if b == nbytes)]
                self._launch("kdtree_bench_rows", (w, n, kk, self.bufs[j % 2].data_ptr(),
                                                   self.bufs[(j + 1) % 2].data_ptr(), 1),
                             (ptr, i32, i32, ptr, ptr, i32), pdl=True, grid=-(-n // 16), threads=32 * warps)
                continue
            src, dst = self.bufs[j % 2].data_ptr(), self.bufs[(j + 1) % 2].data_ptr()
            self._launch("kdtree_bench_stream", (w, words, src, dst, int(mode == "pdl_early")),
                         (ptr, u64, ptr, ptr, i32), pdl=mode != "plain")

    def time_us(self, mode: str, nbytes: int, reps: int) -> tuple[float, int]:
        """(µs a kernel or phase: the best of `reps` replays of one graph / K, K)."""
        torch = self.torch
        k = chain_length(nbytes)
        stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream):
            self._record(mode, nbytes, k)  # warm-up, outside the graph
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            self._record(mode, nbytes, k)
        graph.replay()
        torch.cuda.synchronize(self.device)
        best = float("inf")
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) * 1e3 / k)
        if int(self.bar[0].item()) != 0:
            raise RuntimeError("boundary_cost: the grid barrier's arrival count is not back to 0 after a replay")
        return best, k


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="0 B and o_proj's 14.7 MB only, fewer replays")
    args = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("boundary_cost: needs a CUDA GPU")
    bench = Bench(torch.device("cuda", torch.cuda.current_device()))
    sizes = {n: b for n, b in SIZES.items() if not args.quick or n in ("none", "o_proj")}
    rows = []
    for size, nbytes in sizes.items():
        for mode in MODES:
            if mode == "rows_early" and size not in ROWS_SHAPES:
                continue
            try:
                us, k = bench.time_us(mode, nbytes, 5 if args.quick else 20)
            except RuntimeError as exc:  # e.g. a driver that refuses a cooperative launch in a capture: say so, go on
                rows.append(dict(weights=size, bytes=nbytes, mode=mode, error=str(exc)[:200]))
                print(f"{size} {mode}: {exc}", flush=True)
                continue
            bytes_us = nbytes / bench.rate * 1e6
            n_rows, _, warps = ROWS_SHAPES.get(size, (0, 0, 0))
            ctas, threads = (-(-n_rows // 16), 32 * warps) if mode == "rows_early" else (bench.sms, THREADS)
            rows.append(dict(weights=size, bytes=nbytes, mode=mode, kernels=k, ctas=ctas, threads=threads,
                             us_per_kernel=round(us, 3), bytes_us=round(bytes_us, 3),
                             roofline_fraction=round(bytes_us / us, 3) if nbytes else None,
                             fixed_us=round(us - bytes_us, 3)))
    by = {(r["weights"], r["mode"]): r for r in rows}
    for r in rows:  # each mode against the PDL chain with early weights (the runtime's way) at the same size
        ref = by.get((r["weights"], "pdl_early"))
        r["vs_pdl_early_us"] = round(r["us_per_kernel"] - ref["us_per_kernel"], 3) \
            if ref and "error" not in ref and "error" not in r else None
    path = write_result("boundary-cost", rows, extra=dict(
        copy_bytes_per_s=round(bench.rate, -9), cubin=bench.where,
        timing="one CUDA graph of K kernels (or one launch of K phases), best of the replays / K",
        prediction="H100: plain ~2.0 µs a kernel at 0 B, PDL ~1.0, barrier ~0.6; pdl_early 14.7 MB ~5.5 µs, "
                   "30.3 MB ~10.8 µs"), out_dir=args.out)
    print(f"wrote {path}")
    print_table(rows, ["weights", "mode", "kernels", "us_per_kernel", "bytes_us", "roofline_fraction", "fixed_us",
                       "vs_pdl_early_us"])


if __name__ == "__main__":
    main()
