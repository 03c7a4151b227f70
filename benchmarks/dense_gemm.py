"""The skinny GEMM (plugins/dense_gemm, Triton) against cuBLAS as runtime/model/layers.linear calls it
(F.linear / mm(out_dtype=fp32) / addmm), side by side on the same weights and inputs, for one TP8 rank of
K2.6's projections (config.K26_SHAPES) at t in {1, 2, 5, 9, 17, 33, 65}.

Timing: each side as a CUDA graph of `calls` back-to-back calls (benchmarks/common.time_us(graph=True),
the median replay / calls), the calls cycling through enough copies of W (>= 256 MB in all) that no weight
is read from the H200's 50 MB L2, as in a decode step where every projection's weights are cold.  Bytes:
W + x + y (+ c); fraction = the 4.25 TB/s roofline's µs / measured µs.  Kernels: torch.profiler's CUDA
kernels of one eager call (cuBLAS's splitKreduce shows here).  Before timing, the kernel's error against
the fp64 reference.  A shape the small-n rule declines (router_gate_up) is still timed on its default
config ("declined": true: skinny_linear returns None there and the caller keeps cuBLAS).

    python3 benchmarks/dense_gemm.py [--out DIR] [--shapes qkv_a,lm_head] [--t 1,17]
    python3 benchmarks/dense_gemm.py --sweep [--out DIR]     # every config.candidates entry per (shape, t)

Writes <out>/dense_gemm[_TAG].json (--sweep: dense_gemm_sweep[_TAG].json, with the winners as TABLE lines)
after every shape, so a timeout keeps what was measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import print_table, roofline_us, time_us, write_result  # noqa: E402
from plugins.dense_gemm import skinny_linear, skinny_linear_reference  # noqa: E402
from plugins.dense_gemm.config import K26_SHAPES, candidates, declines, pick_config, t_bucket  # noqa: E402
from runtime.model.layers import linear  # noqa: E402

T_VALUES = (1, 2, 5, 9, 17, 33, 65)
COLD_BYTES = 256 << 20  # weight copies per shape so that a graph's calls read >= this much
MIN_CALLS = 20


def make_shape(name: str, dev) -> dict:
    n, k, out, with_c = K26_SHAPES[name]
    g = torch.Generator(device=dev).manual_seed(0)
    copies = max(1, min(64, -(-COLD_BYTES // (n * k * 2))))
    ws = [(torch.randn(n, k, device=dev, generator=g) / k ** 0.5).to(torch.bfloat16) for _ in range(copies)]
    return {"name": name, "n": n, "k": k, "with_c": with_c, "ws": ws, "g": g,
            "out_dtype": torch.float32 if out == "fp32" else torch.bfloat16}


def kernels_of(fn) -> list[str]:
    """Names of the CUDA kernels one call launches (torch.profiler, after a warm-up call)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [ev.name for ev in prof.events() if ev.device_type.name == "CUDA" and "Memcpy" not in ev.name]


def graph_us(call, ws: list[torch.Tensor]) -> float:
    """µs per call: a graph of max(MIN_CALLS, len(ws)) calls, each on the next copy of W."""
    calls = max(MIN_CALLS, len(ws))
    return time_us(lambda: [call(ws[i % len(ws)]) for i in range(calls)], graph=True) / calls


def bench_one(sh: dict, t: int, dev, sweep: bool) -> dict:
    n, k, od = sh["n"], sh["k"], sh["out_dtype"]
    x = torch.randn(t, k, device=dev, generator=sh["g"]).to(torch.bfloat16)  # [t, k]
    c = torch.randn(t, n, device=dev, generator=sh["g"]).to(torch.bfloat16) if sh["with_c"] else None  # [t, n]
    nbytes = n * k * 2 + t * k * 2 + t * n * od.itemsize + (t * n * 2 if c is not None else 0)
    roof = roofline_us(nbytes, 2.0 * t * n * k)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    cfg = pick_config(n, k, t, sms)
    w0 = sh["ws"][0]
    y = skinny_linear(x, w0, c, od, config=cfg)
    ref = skinny_linear_reference(x.double(), w0.double(), c, torch.float64)
    row = {"shape": sh["name"], "n": n, "k": k, "t": t, "t_bucket": t_bucket(t), "out": str(od).split(".")[-1],
           "bytes": nbytes, "roofline_us": roof, "weight_copies": len(sh["ws"]), "declined": declines(n, sms),
           "config": dataclasses.asdict(cfg), "programs": cfg.programs(n, t),
           "rel_err": ((y.double() - ref).norm() / ref.norm()).item()}
    row["cublas_us"] = graph_us(lambda w: linear(x, w, c, od), sh["ws"])
    row["triton_us"] = graph_us(lambda w: skinny_linear(x, w, c, od, config=cfg), sh["ws"])
    for side in ("cublas", "triton"):
        row[f"{side}_fraction"] = roof / row[f"{side}_us"]
    row["cublas_kernels"] = kernels_of(lambda: linear(x, w0, c, od))
    row["triton_kernels"] = kernels_of(lambda: skinny_linear(x, w0, c, od, config=cfg))
    row["speedup"] = row["cublas_us"] / row["triton_us"]
    if sweep:
        tried = []
        for alt in candidates(n, k, t, sms):
            try:
                us = graph_us(lambda w: skinny_linear(x, w, c, od, config=alt), sh["ws"])  # noqa: B023
            except Exception as exc:  # out of shared memory / registers on this GPU: recorded, not fatal
                tried.append({"config": dataclasses.asdict(alt), "error": repr(exc)[:160]})
                continue
            tried.append({"config": dataclasses.asdict(alt), "us": us, "fraction": roof / us})
        ok = [s for s in tried if "us" in s]
        best = min(ok, key=lambda s: s["us"])
        row.update(sweep=tried, best_config=best["config"], best_us=best["us"], best_fraction=best["fraction"],
                   best_speedup=row["cublas_us"] / best["us"])
    return row


def table_lines(rows: list[dict]) -> list[str]:
    """config.TABLE entries from a sweep: per (n, k, t bucket) the config with the least summed µs over its t."""
    per: dict[tuple, dict] = {}
    for r in rows:
        for s in r.get("sweep", []):
            if "us" in s:
                key = (r["n"], r["k"], r["t_bucket"])
                cfg = tuple(s["config"].values())
                per.setdefault(key, {})[cfg] = per.get(key, {}).get(cfg, 0.0) + s["us"]
    return [f"    {key}: GemmConfig{min(v, key=v.get)}," for key, v in sorted(per.items())]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    ap.add_argument("--shapes", default=",".join(K26_SHAPES))
    ap.add_argument("--t", default=",".join(map(str, T_VALUES)))
    ap.add_argument("--sweep", action="store_true", help="also time every config.candidates entry")
    ap.add_argument("--tag", default="", help="suffix of the result file's name (a sweep split over device calls)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    ts = [int(v) for v in args.t.split(",")]
    op = ("dense_gemm_sweep" if args.sweep else "dense_gemm") + (f"_{args.tag}" if args.tag else "")
    rows: list[dict] = []
    extra = {"peers": {"cublas": "runtime.model.layers.linear: F.linear (bf16 out), torch.mm(out_dtype=fp32) "
                                 "(fp32 out), torch.addmm (with c)",
                       "triton": "plugins.dense_gemm.skinny_linear on config.pick_config (forced where declined)"},
             "shapes": {s: K26_SHAPES[s] for s in args.shapes.split(",")}, "t": ts,
             "timing": f"CUDA graph of max({MIN_CALLS}, copies) calls over >= {COLD_BYTES >> 20} MB of weight "
                       "copies, median replay / calls"}
    for name in args.shapes.split(","):
        sh = make_shape(name, dev)
        for t in ts:
            r = bench_one(sh, t, dev, args.sweep)
            rows.append(r)
            best = f", sweep best {r['best_us']:.1f} us {r['best_config']}" if args.sweep else ""
            print(f"{name} t={t}: cublas {r['cublas_us']:.1f} us ({r['cublas_fraction']:.2f}, "
                  f"{len(r['cublas_kernels'])} kernels), triton {r['triton_us']:.1f} us ({r['triton_fraction']:.2f}, "
                  f"{r['programs']} programs), rel err {r['rel_err']:.1e}{best}", flush=True)
        extra["table"] = table_lines(rows) if args.sweep else []
        path = write_result(op, rows, extra=extra, out_dir=args.out)
        del sh
        torch.cuda.empty_cache()
    print(f"wrote {path}")
    if args.sweep:
        print("config.TABLE candidates (least summed us per bucket):\n" + "\n".join(extra["table"]))
    for r in rows:
        r["kern"] = f"{len(r['cublas_kernels'])}/{len(r['triton_kernels'])}"
    print_table(rows, ["shape", "t", "roofline_us", "cublas_us", "cublas_fraction", "triton_us", "triton_fraction",
                       "speedup", "kern", "programs", "declined"] + (["best_us", "best_speedup"] if args.sweep else []))


if __name__ == "__main__":
    main()
