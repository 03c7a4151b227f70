"""Does reading a layer's dense weights from L2 instead of HBM shorten the decode GEMMs?  (issue 15's GEMM gap)

The K2.6 TP8 rank's per-layer dense GEMMs at t = 1 and 16 (runtime.model.layers.linear: the runtime's own kernels,
skinny_gemm / skinny_wgmma, or with --gemm cublas torch's cuBLAS) are timed several ways, each as a CUDA graph of R
calls, median replay / R:
  cold        each call on another copy of the weights (R copies >= 256 MB: every call reads HBM)
  hot         every call on the same weights (L2-resident after the first)
  prefetched  each call preceded by prefetch_l2(its copy) and a spin of D µs on one thread (the stand-in for
              the kernels a prefetch would overlap); the GEMM's time is the graph's minus the same graph without
              the GEMMs; `spread`: the requests 8 KB each from one warp an SM (up to every SM), not 64 KB each
              from a few 128-thread CTAs
and prefetch_l2's own cost on the stream (prefetch + spin minus spin alone).  The same with a 24 MB copy in
place of the spin (other kernels streaming through L2 between prefetch and GEMM), with L2's normal and its
evict-last policy for the prefetched lines.  Prints a table; writes
OUT/l2-prefetch.json.
    python3 benchmarks/l2_prefetch.py --out DIR [--spin-us 10] [--gemm skinny|cublas] [--shapes qkv_a,o_proj]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import print_table, roofline_us, time_us, write_result  # noqa: E402

# name -> (n, k, out dtype): one TP8 rank of K2.6 (benchmarks/results/dense_gemm.json had the same shapes)
SPREAD_CHUNK = 8 << 10  # bytes a request where the requests are spread over many SMs
STREAM_MB = 24  # the streaming copy between prefetch and GEMM: ~ the MoE's touched experts at t = 1
SHAPES = {"qkv_a": (2112, 7168, "bf16"), "q_b": (1536, 1536, "bf16"), "o_proj": (7168, 1024, "bf16"),
          "router_gate_up": (896, 7168, "fp32"), "shared_down": (7168, 256, "bf16")}


def main() -> None:
    import torch
    from cuda.bindings import driver as cu

    from plugins.l2_prefetch.launch import prefetch_l2, spin
    from runtime.model import layers
    from runtime.model.layers import linear

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--spin-us", type=float, default=10.0)
    ap.add_argument("--tokens", default="1,16")
    ap.add_argument("--gemm", choices=("skinny", "cublas"), default="skinny",
                    help="the runtime's GEMM kernels (its default) or cuBLAS (runtime.model.layers.SKINNY_GEMM off)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"a subset of {','.join(SHAPES)}")
    a = ap.parse_args()
    unknown = sorted(set(a.shapes.split(",")) - set(SHAPES))
    if unknown:
        sys.exit(f"l2_prefetch: --shapes: unknown shape(s) {unknown}; known: {','.join(SHAPES)}")
    layers.SKINNY_GEMM = a.gemm == "skinny"
    dev = torch.device("cuda")
    clock_hz = 1.98e9  # H200 boost clock: the spin's cycles per µs (the spin-alone row reports what it took)
    cycles = int(a.spin_us * clock_hz / 1e6)
    torch.manual_seed(0)
    src = torch.empty(STREAM_MB << 20, dtype=torch.uint8, device=dev)
    sink = torch.empty_like(src)
    rows = []
    for name in a.shapes.split(","):
        n, k, out = SHAPES[name]
        nbytes = n * k * 2
        copies = max(20, -(-(256 << 20) // nbytes))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for t in map(int, a.tokens.split(",")):
            x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
            od = torch.float32 if out == "fp32" else torch.bfloat16

            def gemm(w):
                return linear(x, w, out_dtype=od)

            def cold():
                for w in ws:
                    gemm(w)

            def hot():
                for _ in ws:
                    gemm(ws[0])

            def pf_gemm():
                for w in ws:
                    prefetch_l2(w)
                    spin(cycles, dev)
                    gemm(w)

            def pf_only():
                for w in ws:
                    prefetch_l2(w)
                    spin(cycles, dev)

            # the requests spread over up to one warp an SM (8 KB each), instead of a few 128-thread CTAs
            def pf_spread_gemm():
                for w in ws:
                    prefetch_l2(w, chunk=SPREAD_CHUNK, threads=32)
                    spin(cycles, dev)
                    gemm(w)

            def pf_spread():
                for w in ws:
                    prefetch_l2(w, chunk=SPREAD_CHUNK, threads=32)
                    spin(cycles, dev)

            def spin_gemm():
                for w in ws:
                    spin(cycles, dev)
                    gemm(w)

            def spin_only():
                for _ in ws:
                    spin(cycles, dev)

            # between the prefetch and the GEMM, other kernels stream STREAM_MB through L2 (as the MoE's experts
            # do): do the prefetched lines survive, with L2's normal and its evict-last policy?
            def pf_stream_gemm(evict_last=False):
                for w in ws:
                    prefetch_l2(w, evict_last=evict_last)
                    sink.copy_(src)
                    gemm(w)

            def pf_stream(evict_last=False):
                for w in ws:
                    prefetch_l2(w, evict_last=evict_last)
                    sink.copy_(src)

            def stream_gemm():
                for w in ws:
                    sink.copy_(src)
                    gemm(w)

            def stream_only():
                for _ in ws:
                    sink.copy_(src)

            def pf_last_stream_gemm():
                pf_stream_gemm(True)

            def pf_last_stream():
                pf_stream(True)

            us = {f.__name__: time_us(f, graph=True) / copies
                  for f in (cold, hot, pf_gemm, pf_only, pf_spread_gemm, pf_spread, spin_gemm, spin_only,
                            pf_stream_gemm, pf_stream,
                            stream_gemm, stream_only, pf_last_stream_gemm, pf_last_stream)}
            roof = roofline_us(nbytes + t * k * 2 + t * n * (4 if out == "fp32" else 2))
            rows.append({"shape": name, "gemm": a.gemm, "n": n, "k": k, "t": t, "bytes": nbytes,
                         "roofline_us": round(roof, 2),
                         "cold_us": round(us["cold"], 2), "hot_us": round(us["hot"], 2),
                         "after_spin_us": round(us["spin_gemm"] - us["spin_only"], 2),
                         "prefetched_us": round(us["pf_gemm"] - us["pf_only"], 2),
                         "prefetch_cost_us": round(us["pf_only"] - us["spin_only"], 2),
                         "prefetched_spread_us": round(us["pf_spread_gemm"] - us["pf_spread"], 2),
                         "prefetch_spread_cost_us": round(us["pf_spread"] - us["spin_only"], 2),
                         "spin_us": round(us["spin_only"], 2), "copies": copies,
                         "after_stream_us": round(us["stream_gemm"] - us["stream_only"], 2),
                         "prefetched_stream_us": round(us["pf_stream_gemm"] - us["pf_stream"], 2),
                         "prefetched_last_stream_us": round(us["pf_last_stream_gemm"] - us["pf_last_stream"], 2),
                         "cold_fraction": round(roof / us["cold"], 3),
                         "prefetched_fraction": round(roof / max(us["pf_gemm"] - us["pf_only"], 1e-3), 3)})
            print(rows[-1], flush=True)
            cu.cuCtxResetPersistingL2Cache()  # evict-last lines back to normal before the next measurement
        ws.clear()  # free the copies before the next shape
    extra = {"spin_us_asked": a.spin_us, "timing": "CUDA graph of one call per weight copy, median replay / calls",
             "gemm": f"runtime.model.layers.linear ({a.gemm})", "prefetch": "plugins/l2_prefetch (cp.async.bulk."
             "prefetch.L2, 64 KB requests)"}
    path = write_result("l2-prefetch", rows, extra, a.out)
    print(f"wrote {path}")
    print_table(rows, ["shape", "t", "roofline_us", "cold_us", "hot_us", "after_spin_us", "prefetched_us",
                       "prefetched_spread_us", "prefetch_spread_cost_us",
                       "prefetch_cost_us", "after_stream_us", "prefetched_stream_us", "prefetched_last_stream_us"])


if __name__ == "__main__":
    main()
