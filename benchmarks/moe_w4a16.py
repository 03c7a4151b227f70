"""Benchmark of kdtree::moe_w4a16 (routing + INT4 routed experts of one MoE layer) on the H200.

Shapes: K2.6 at TP8 (one rank: 384 experts x intermediate 256, hidden 7168, top-8) for
t in {1, 8, 16, 64, 256, 512}, and at EP8 (one rank: 48 whole experts x 2048) for t in {1, 16, 64}.
Routing: "tree" — logits from a low-rank random projection of a per-token latent that follows a
random walk over the token index (z_t = 0.9 z_{t-1} + 0.44 eps, rank 8, plus small iid noise), so
neighbouring tokens (siblings / ancestors of a tree) share experts, as tree tokens do; "uniform" —
iid N(0, 1) logits.  The distinct experts touched per t are reported for both.

Roofline bytes = the touched experts' packed weights + scales (each read once) + x read + logits read
+ y written; flops = 2 * t * K * 3 * d * i (tensor work of the experts; far below the byte time).
Peers in the same run: the torch dequantise reference (route, then per touched expert: dequantise
INT4 -> bf16 and matmul; t <= 16 only) and a bf16 grouped GEMM on dequantised weights
(torch._grouped_mm over expert-sorted tokens; the "no INT4 kernel" peer).  Our op is timed as a CUDA
graph replay (the memset and five launches, scratch from a MoEWorkspace allocated once), the peers
eagerly.  A small tile sweep (KernelConfig variants) runs on the TP8 tree shapes; the default heuristic's
row is the headline.

    python3 benchmarks/moe_w4a16.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import kernel_us, print_table, roofline_us, time_us, write_result  # noqa: E402
from plugins.moe_w4a16 import MoEWorkspace, moe_w4a16, route_reference  # noqa: E402
from plugins.moe_w4a16.launch import moe_w4a16_triton  # noqa: E402
from plugins.moe_w4a16.layout import dequantize_kernel_layout, padded_k  # noqa: E402
from plugins.moe_w4a16.plan import KernelConfig, launch_plan  # noqa: E402

D, E, K, SCALING = 7168, 384, 8, 2.827
# tile sweep on the TP8 tree rows: each entry changes the default (launch_plan's choices for its 0 fields);
# packed=False: one weight per dequantising instruction; grid_e=1 << 20: one program per expert slot (no loop)
SWEEP = [KernelConfig(packed=False), KernelConfig(grid_e=1 << 20), KernelConfig(packed=False, grid_e=1 << 20)]


def make_experts(e_local: int, i: int, dev) -> dict:
    g = torch.Generator(device=dev).manual_seed(0)

    def one(n, k):
        w = torch.randint(-2**31, 2**31 - 1, (e_local, n, padded_k(k) // 8), device=dev, dtype=torch.int32,
                          generator=g)
        s = (torch.rand(e_local, padded_k(k) // 32, n, device=dev, generator=g) * 0.01 + 0.002).to(torch.bfloat16)
        return w, s
    (w13, s13), (w2, s2) = one(2 * i, D), one(D, i)
    return {"w13": w13, "s13": s13, "w2": w2, "s2": s2, "i": i, "e_local": e_local}


def make_inputs(t: int, routing: str, dev, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(t, D, device=dev, generator=g).to(torch.bfloat16)
    if routing == "uniform":
        logits = torch.randn(t, E, device=dev, generator=g)
    else:
        r = 8
        z = torch.empty(t, r, device=dev)
        z[0] = torch.randn(r, device=dev, generator=g)
        eps = torch.randn(t, r, device=dev, generator=g)
        for j in range(1, t):  # random walk over the token index: neighbours correlate
            z[j] = 0.9 * z[j - 1] + 0.44 * eps[j]
        proj = torch.randn(r, E, device=dev, generator=g)
        logits = z @ proj + 0.3 * torch.randn(t, E, device=dev, generator=g)
    bias = torch.randn(E, device=dev, generator=g) * 0.05
    return x, logits.contiguous(), bias


def touched(logits, bias, e_start, e_local) -> int:
    idx, _ = route_reference(logits, bias, K, 1, 1, True, SCALING)
    u = torch.unique(idx)
    return int(((u >= e_start) & (u < e_start + e_local)).sum())


def bytes_per_expert(ex: dict) -> int:
    """Packed weights + scales of ONE expert (index 0 of each [e, ...] tensor)."""
    return sum(ex[k][0].numel() * ex[k][0].element_size() for k in ("w13", "s13", "w2", "s2"))


def dequant_reference(x, logits, bias, ex, e_start):
    """Peer: route, then per touched expert dequantise INT4 -> bf16 and matmul (host loop)."""
    idx, tw = route_reference(logits, bias, K, 1, 1, True, SCALING)
    y = torch.zeros_like(x)
    i = ex["i"]
    for e in torch.unique(idx).tolist():
        if not e_start <= e < e_start + ex["e_local"]:
            continue
        le = e - e_start
        tok, slot = torch.where(idx == e)
        w13 = dequantize_kernel_layout(ex["w13"][le], ex["s13"][le], D).to(x.dtype)
        w2 = dequantize_kernel_layout(ex["w2"][le], ex["s2"][le], i).to(x.dtype)
        gate, up = F.linear(x[tok], w13).chunk(2, dim=-1)
        y.index_add_(0, tok, (F.linear(F.silu(gate) * up, w2) * tw[tok, slot, None]).to(y.dtype))
    return y


def grouped_mm_peer(x, logits, bias, w13t, w2t, e_start, e_local):
    """Peer: bf16 grouped GEMM on dequantised weights (w13t [e, d, 2i], w2t [e, i, d]), tokens sorted by expert."""
    idx, tw = route_reference(logits, bias, K, 1, 1, True, SCALING)
    flat = idx.reshape(-1) - e_start
    ok = (flat >= 0) & (flat < e_local)
    key = torch.where(ok, flat, e_local)  # non-local slots sort last and are dropped by offs
    order = torch.argsort(key)
    counts = torch.bincount(key, minlength=e_local + 1)[:e_local]
    offs = torch.cumsum(counts, 0).to(torch.int32)
    tok = order // K
    xs = x[tok]  # [t*K, d] (tail beyond offs[-1] ignored)
    h = torch._grouped_mm(xs, w13t, offs=offs)
    gate, up = h.chunk(2, dim=-1)
    o = torch._grouped_mm((F.silu(gate) * up).contiguous(), w2t, offs=offs)
    wts = torch.where(ok, tw.reshape(-1), 0.0)[order]
    o = torch.where(ok[order][:, None], o.float() * wts[:, None], 0.0)  # rows past offs[-1] are unset
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    y.index_add_(0, tok, o)
    return y.to(x.dtype)


def dense_copy(ex: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 dequantised experts as torch._grouped_mm's B operands: [e, d, 2i] and [e, i, d] (column-major views)."""
    w13 = torch.stack([dequantize_kernel_layout(ex["w13"][j], ex["s13"][j], D).to(torch.bfloat16)
                       for j in range(ex["e_local"])])  # [e, 2i, d]
    w2 = torch.stack([dequantize_kernel_layout(ex["w2"][j], ex["s2"][j], ex["i"]).to(torch.bfloat16)
                      for j in range(ex["e_local"])])  # [e, d, i]
    return w13.transpose(1, 2), w2.transpose(1, 2)


def bench_shape(name, t, routing, ex, e_start, dev, peers: bool, sweep: list[KernelConfig], dense=None) -> list[dict]:
    x, logits, bias = make_inputs(t, routing, dev, seed=t)
    e_local, i = ex["e_local"], ex["i"]
    n_touch = touched(logits, bias, e_start, e_local)
    nbytes = n_touch * bytes_per_expert(ex) + t * D * 2 * 2 + t * E * 4  # touched experts + x, y, logits
    flops = 2.0 * t * K * 3 * D * i
    roof = roofline_us(nbytes, flops)
    args = (x, logits, None, bias, ex["w13"], ex["s13"], ex["w2"], ex["s2"], K, 1, 1, True, SCALING, e_start)
    ws = MoEWorkspace.allocate(t, K, e_local, D, i, x.dtype, dev)  # allocated once, as the runtime does
    op = lambda: moe_w4a16(*args, ws.buffer)  # noqa: E731
    us = time_us(op, graph=True)
    row = {"shape": name, "t": t, "routing": routing, "experts_touched": n_touch, "bytes": nbytes,
           "roofline_us": roof, "us": us, "roofline_fraction": roof / us,
           "config": launch_plan(t, K, e_local, D, i, dev).cfg.__dict__}
    if peers and t <= 16:
        row["torch_dequant_ref_us"] = time_us(lambda: dequant_reference(x, logits, bias, ex, e_start))
    if peers and dense is not None:
        try:
            row["bf16_grouped_mm_us"] = time_us(lambda: grouped_mm_peer(x, logits, bias, *dense, e_start, e_local))
        except Exception as exc:  # torch build without _grouped_mm for these shapes
            row["bf16_grouped_mm_error"] = repr(exc)[:200]
    rows = [row]
    row_major = {}  # the same scales stored [e, n, g] (viewed [e, g, n]) for the scale_tile rows
    for cfg in sweep:
        call = list(args[3:])
        if cfg.scale_tile:
            if not row_major:
                row_major.update(s13=ex["s13"].transpose(1, 2).contiguous().transpose(1, 2),
                                 s2=ex["s2"].transpose(1, 2).contiguous().transpose(1, 2))
            call[2], call[4] = row_major["s13"], row_major["s2"]
        f = lambda: moe_w4a16_triton(x, logits, *call, config=cfg)  # noqa: E731  (launcher: no gate arg)
        try:
            v = time_us(f, graph=True)
            rows.append({"shape": name + "/sweep", "t": t, "routing": routing, "experts_touched": n_touch,
                         "bytes": nbytes, "roofline_us": roof, "us": v, "roofline_fraction": roof / v,
                         "config": cfg.__dict__})
        except Exception as exc:
            rows.append({"shape": name + "/sweep", "t": t, "config": cfg.__dict__, "error": repr(exc)[:200]})
    return rows


def check_once(ex, dev) -> float:
    """One correctness check before timing (fp32 reference on the dequantised touched experts)."""
    x, logits, bias = make_inputs(16, "tree", dev, seed=99)
    y = moe_w4a16(x, logits, None, bias, ex["w13"], ex["s13"], ex["w2"], ex["s2"], K, 1, 1, True, SCALING, 0)
    ref = dequant_reference(x.float(), logits, bias, {**ex}, 0)
    return ((y.float() - ref).norm() / ref.norm()).item()


def profile_launches(dev, out_dir) -> None:
    """Device time per launch of the op (torch.profiler / CUPTI, eager calls), for the diagnosis in NOTES.md."""
    rows = []
    for name, e_local, i, e_start, ts in (("k26_tp8", E, 256, 0, (1, 16, 64, 512)),
                                          ("k26_ep8", 48, 2048, 144, (1, 16))):
        ex = make_experts(e_local, i, dev)
        for t in ts:
            for routing in ("tree", "uniform"):
                x, logits, bias = make_inputs(t, routing, dev, seed=t)
                ws = MoEWorkspace.allocate(t, K, e_local, D, i, x.dtype, dev)
                args = (x, logits, None, bias, ex["w13"], ex["s13"], ex["w2"], ex["s2"], K, 1, 1, True, SCALING,
                        e_start, ws.buffer)
                # µs per op call, by the kernel name's first 40 characters
                per = {k: round(v, 2) for k, v in kernel_us(lambda: moe_w4a16(*args), name_chars=40).items()}  # noqa: B023
                row = {"shape": f"{name}_t{t}", "routing": routing, "experts_touched": touched(logits, bias, e_start,
                                                                                               e_local),
                       "launch_us": per, "sum_us": round(sum(per.values()), 2)}
                rows.append(row)
                print(row, flush=True)
        del ex
        torch.cuda.empty_cache()
    write_result("moe_w4a16_launches", rows, out_dir=out_dir)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer token counts, no peers, no tile sweep")
    ap.add_argument("--no-sweep", action="store_true", help="all shapes and peers, no tile sweep")
    ap.add_argument("--profile", action="store_true", help="only the per-launch device times (torch.profiler)")
    ap.add_argument("--sweep-only", action="store_true",
                    help="only the tile sweep on the TP8 tree rows (moe_w4a16_sweep.json, rewritten after each t)")
    ap.add_argument("--calls-only", type=int, metavar="T", default=0,
                    help="only 3 eager calls at TP8 tree routing with T tokens (a target for ncu)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    if args.calls_only:
        ex = make_experts(E, 256, dev)
        x, logits, bias = make_inputs(args.calls_only, "tree", dev, seed=args.calls_only)
        for _ in range(3):
            moe_w4a16(x, logits, None, bias, ex["w13"], ex["s13"], ex["w2"], ex["s2"], K, 1, 1, True, SCALING, 0)
        torch.cuda.synchronize()
        return
    if args.profile:
        profile_launches(dev, args.out)
        return
    if args.sweep_only:
        tp8, rows = make_experts(E, 256, dev), []
        for t in (1, 16, 64, 512):
            rows += bench_shape(f"k26_tp8_t{t}", t, "tree", tp8, 0, dev, peers=False, sweep=SWEEP)
            write_result("moe_w4a16_sweep", rows, out_dir=args.out)
            for r in rows[-len(SWEEP) - 1:]:
                print(f"t={t} {r.get('us', float('nan')):8.1f} us {r.get('roofline_fraction', 0):.3f} {r['config']}",
                      flush=True)
        return
    ts = [1, 16, 64, 512] if args.quick else [1, 8, 16, 64, 256, 512]
    rows: list[dict] = []

    tp8 = make_experts(E, 256, dev)
    rel = check_once(tp8, dev)
    print(f"check TP8 t=16: rel err {rel:.2e} vs fp32 dequantised reference")
    dense = None if args.quick else dense_copy(tp8)
    sweep = [] if args.quick or args.no_sweep else SWEEP
    for t in ts:
        for routing in ("tree", "uniform"):
            rows += bench_shape(f"k26_tp8_t{t}", t, routing, tp8, 0, dev, peers=True,
                                sweep=sweep if routing == "tree" else [], dense=dense)
    del tp8, dense
    torch.cuda.empty_cache()

    ep8 = make_experts(48, 2048, dev)
    dense = None if args.quick else dense_copy(ep8)
    for t in ([1, 64] if args.quick else [1, 16, 64]):
        for routing in ("tree", "uniform"):
            rows += bench_shape(f"k26_ep8_t{t}", t, routing, ep8, 48 * 3, dev, peers=True, sweep=[], dense=dense)

    path = write_result("moe_w4a16", rows, extra={"check_rel_err_t16": rel}, out_dir=args.out)
    print(f"wrote {path}")
    head = [r for r in rows if "/sweep" not in r["shape"]]
    print_table(head, ["shape", "routing", "experts_touched", "roofline_us", "us", "roofline_fraction",
                       "torch_dequant_ref_us", "bf16_grouped_mm_us"])
    best = {}
    for r in rows:
        if r.get("routing") == "tree" and "us" in r and r["shape"].startswith("k26_tp8"):
            key = r["t"]
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
    print("best config per t (tp8, tree):")
    for t, r in sorted(best.items()):
        print(f"  t={t}: {r['us']:.1f} us ({r['roofline_fraction']:.2f} of roofline) {r['config']}")


if __name__ == "__main__":
    main()
