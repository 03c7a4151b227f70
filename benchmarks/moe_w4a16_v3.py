"""moe_w4a16 v3 (fragment-order INT4 experts, CUDA C mma.sync GEMMs) against v2c (planar layout, Triton) and a
bf16 grouped GEMM on dequantised weights, side by side in one run, on the same experts and inputs.

Shapes and routing as benchmarks/moe_w4a16.py: K2.6 TP8 rank (384 experts x 256, hidden 7168, top-8) at
t in {1, 8, 9, 16, 17, 33, 64, 129, 256, 257, 512, 1024} (--quick: 1, 9, 17, 64, 257, 512), EP8 rank (48 whole
experts x 2048) at t in {1, 16, 64}; "tree" (neighbouring tokens share experts) and "uniform" routing.  Roofline
bytes: the touched experts' packed weights + scales + x, y, logits (benchmarks/moe_w4a16.py's count; v3's layout
holds the same bytes per expert).  Both kernel paths are timed as CUDA graph replays (scratch from a MoEWorkspace
allocated once), the peer eagerly.
v3 is timed with the defaults (launch_v3: down's weights before its PDL wait, the 16-warp gate_up where it applies:
t = 1; the wgmma GEMMs where launch_wgmma.applies), with the expert GEMMs on the mma.sync kernels (v3_mma) and on
moe_wgmma.cu's wgmma kernels (v3_wg, where the shapes suit them) at every t, and on the mma.sync kernels with their L2
prefetch of the expert weights (v3_pf, KDTREE_MOE_PREFETCH=1), with down's weights after the wait (v3_late_w8,
v3_late_w16 with the 16-warp gate_up), and early with the 8-warp gate_up (v3_early_w8); at t = 8, 9, 16, 17, 33, 64,
256, 512 also with another token tile where the mma.sync kernels run (v3_nt{1,2,4}_us: launch_v3.token_tile's choice
checked).
Before timing: v3 against the fp32 reference on the dequantised experts and against v2c at t = 16.
Writes benchmarks/results/moe_w4a16_v3.json and moe_w4a16_v3.png (fraction of roofline against t).

    python3 benchmarks/moe_w4a16_v3.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import kernel_us, print_table, roofline_us, time_us, write_result  # noqa: E402
from benchmarks.moe_w4a16 import SCALING, D, E, K, grouped_mm_peer, make_inputs, touched  # noqa: E402
from plugins.moe_w4a16 import (  # noqa: E402
    MoEWorkspace,
    experts_reference,
    moe_w4a16,
    planar_copy,
    route_reference,
)
from plugins.moe_w4a16.fragment_layout import dequantize_fragments  # noqa: E402
from plugins.moe_w4a16 import launch_v3, launch_wgmma  # noqa: E402
from plugins.moe_w4a16.launch_v3 import PREFETCH_ENV, kernels  # noqa: E402


def make_experts(e_local: int, i: int, dev) -> dict:
    """Random fragment-order experts (every word valid; 7168 / 256 / 2048 need no k padding) and the same
    experts in the planar layout (v2c) and as bf16 grouped-GEMM operands."""
    g = torch.Generator(device=dev).manual_seed(0)

    def one(n, k):
        w = torch.randint(-2**31, 2**31 - 1, (e_local, n // 32, k // 32, 32, 4), device=dev, dtype=torch.int32,
                          generator=g)
        s = (torch.rand(e_local, n // 32, k // 32, 8, 4, device=dev, generator=g) * 0.01 + 0.002).to(torch.bfloat16)
        return w, s
    (w13, s13), (w2, s2) = one(2 * i, D), one(D, i)
    frag = (w13, s13, w2, s2)
    return {"frag": frag, "planar": planar_copy(*frag, D), "i": i, "e_local": e_local,
            "bytes_per_expert": sum(a[0].numel() * a[0].element_size() for a in frag)}


def dense_operands(ex: dict) -> tuple[torch.Tensor, torch.Tensor]:
    w13, s13, w2, s2 = ex["frag"]
    a = torch.stack([dequantize_fragments(w13[j], s13[j], D, True).to(torch.bfloat16) for j in range(ex["e_local"])])
    b = torch.stack([dequantize_fragments(w2[j], s2[j], ex["i"], False).to(torch.bfloat16)
                     for j in range(ex["e_local"])])
    return a.transpose(1, 2), b.transpose(1, 2)  # [e, d, 2i], [e, i, d] column-major views


def check(ex: dict, dev) -> dict:
    x, logits, bias = make_inputs(16, "tree", dev, seed=99)
    y3 = moe_w4a16(x, logits, None, bias, *ex["frag"], K, 1, 1, True, SCALING, 0)
    y2 = moe_w4a16(x, logits, None, bias, *ex["planar"], K, 1, 1, True, SCALING, 0)
    idx, tw = route_reference(logits, bias, K, 1, 1, True, SCALING)
    w13, s13, w2, s2 = ex["frag"]
    used = torch.unique(idx)
    w13f = torch.zeros(ex["e_local"], 2 * ex["i"], D, device=dev)
    w2f = torch.zeros(ex["e_local"], D, ex["i"], device=dev)
    for e in used.tolist():  # only the touched experts dequantised (fp32 copies of all 384 would be 8 GB)
        w13f[e] = dequantize_fragments(w13[e], s13[e], D, True)
        w2f[e] = dequantize_fragments(w2[e], s2[e], ex["i"], False)
    ref = experts_reference(x.float(), idx, tw, w13f, w2f, 0)
    rel = lambda y: ((y.float() - ref).norm() / ref.norm()).item()  # noqa: E731
    return {"t": 16, "v3_rel_err": rel(y3), "v2c_rel_err": rel(y2),
            "v3_vs_v2c_rel": ((y3.float() - y2.float()).norm() / y2.float().norm()).item()}


def bench_shape(name: str, t: int, routing: str, ex: dict, e_start: int, dev, dense) -> dict:
    x, logits, bias = make_inputs(t, routing, dev, seed=t)
    e_local, i = ex["e_local"], ex["i"]
    n_touch = touched(logits, bias, e_start, e_local)
    nbytes = n_touch * ex["bytes_per_expert"] + t * D * 2 * 2 + t * E * 4
    roof = roofline_us(nbytes, 2.0 * t * K * 3 * D * i)
    ws = MoEWorkspace.allocate(t, K, e_local, D, i, x.dtype, dev)
    row = {"shape": name, "t": t, "routing": routing, "experts_touched": n_touch, "bytes": nbytes,
           "roofline_us": roof}
    # v3_pf: v3 with its L2 prefetch of the expert weights (KDTREE_MOE_PREFETCH, read when the graph is captured);
    # v3_late_w8 / _w16: down's weights loaded after its PDL wait (launch_v3.EARLY_WEIGHTS off), with the 8- / 16-warp
    # gate_up (launch_v3.USE_W16: the 16-warp one where it applies, t = 1); v3_early_w8: before the wait, 8 warps
    # v3_mma / v3_wg: the expert GEMMs on v3's mma.sync kernels / on moe_wgmma.cu's (launch_wgmma.FORCE), where v3
    # takes the one launch_wgmma.applies picks; v3_wg only where the experts' shapes suit it (not EP8's i = 2048)
    w16_default, early_default = launch_v3.USE_W16, launch_v3.EARLY_WEIGHTS
    wg_fits = launch_wgmma.shapes_fit(*ex["frag"][0].shape[1:3], *ex["frag"][2].shape[1:3])
    for label, experts, pf, w16, early, wg in (
            ("v3", ex["frag"], "0", w16_default, early_default, None),
            ("v3_mma", ex["frag"], "0", w16_default, early_default, False),
            *((("v3_wg", ex["frag"], "0", w16_default, early_default, True),) if wg_fits else ()),
            ("v3_pf", ex["frag"], "1", w16_default, early_default, False),
            ("v3_late_w8", ex["frag"], "0", False, False, False),
            ("v3_late_w16", ex["frag"], "0", True, False, False),
            ("v3_early_w8", ex["frag"], "0", False, True, False),
            ("v2c", ex["planar"], "0", True, False, None)):
        os.environ[PREFETCH_ENV] = pf
        launch_v3.USE_W16, launch_v3.EARLY_WEIGHTS, launch_wgmma.FORCE = w16, early, wg
        call = lambda: moe_w4a16(x, logits, None, bias, *experts, K, 1, 1, True, SCALING, e_start,  # noqa: E731,B023
                                 ws.buffer)
        us = time_us(call, graph=True)
        row[f"{label}_us"], row[f"{label}_fraction"] = us, roof / us
    os.environ.pop(PREFETCH_ENV)
    launch_v3.USE_W16, launch_v3.EARLY_WEIGHTS, launch_wgmma.FORCE = w16_default, early_default, None
    if t == 1:  # v3_one: gate_up and down in one grid (launch_v3.ONE_LAUNCH) where one_launch_applies
        one_default, launch_v3.ONE_LAUNCH = launch_v3.ONE_LAUNCH, True
        call = lambda: moe_w4a16(x, logits, None, bias, *ex["frag"], K, 1, 1, True, SCALING, e_start,  # noqa: E731
                                 ws.buffer)
        row["v3_one_us"] = us = time_us(call, graph=True)
        row["v3_one_fraction"] = roof / us
        launch_v3.ONE_LAUNCH = one_default
    # another token tile than the choice (launch_v3.token_tile: NT = 1 to t = 17, then 2): is the switch at the right
    # t under tree routing, where most experts see a few of the tokens, and does NT = 4 still lose at many tokens?
    other = {8: 2, 9: 2, 16: 2, 17: 2, 33: 1, 64: 4, 256: 4, 512: 4}.get(t)
    if other is not None and not launch_wgmma.applies(t, dev, *ex["frag"][0].shape[1:3], *ex["frag"][2].shape[1:3]):
        call = lambda: moe_w4a16(x, logits, None, bias, *ex["frag"], K, 1, 1, True, SCALING, e_start,  # noqa: E731
                                 ws.buffer)
        want = call()
        launch_v3.TOKEN_TILE_OVERRIDE = other
        try:
            row[f"v3_nt{other}_same_bits"] = bool(torch.equal(call(), want))  # a column's sum order is NT's own
            row[f"v3_nt{other}_us"] = time_us(call, graph=True)
        finally:
            launch_v3.TOKEN_TILE_OVERRIDE = None
    if dense is not None:
        try:
            row["bf16_grouped_mm_us"] = time_us(lambda: grouped_mm_peer(x, logits, bias, *dense, e_start, e_local))
        except Exception as exc:  # torch build without _grouped_mm for these shapes
            row["bf16_grouped_mm_error"] = repr(exc)[:200]
    return row


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for shape, routing, style in (("k26_tp8", "tree", "-"), ("k26_tp8", "uniform", "--"), ("k26_ep8", "tree", ":")):
        sel = [r for r in rows if r["shape"].startswith(shape) and r["routing"] == routing]
        if not sel:
            continue
        for label, color in (("v3_mma", "tab:blue"), ("v3_wg", "tab:red"), ("v2c", "tab:orange")):
            got = [(r["t"], r[f"{label}_fraction"]) for r in sel if f"{label}_fraction" in r]
            if got:
                ax.plot(*zip(*got), style, color=color, marker="o", label=f"{label} {shape} {routing}")
    ax.axhline(0.5, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens t")
    ax.set_ylabel("fraction of the HBM roofline")
    ax.set_title("moe_w4a16: v3 mma.sync / wgmma (CUDA C, fragment order) vs v2c (Triton)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def profile(dev, ts: list[int]) -> None:
    """Per-launch device times (torch.profiler) of v3 and v2c, TP8 tree routing; a target for ncu too."""
    tp8 = make_experts(E, 256, dev)
    for t in ts:
        x, logits, bias = make_inputs(t, "tree", dev, seed=t)
        ws = MoEWorkspace.allocate(t, K, E, D, 256, x.dtype, dev)
        for label, experts in (("v3", tp8["frag"]), ("v2c", tp8["planar"])):
            call = lambda: moe_w4a16(x, logits, None, bias, *experts, K, 1, 1, True, SCALING, 0, ws.buffer)  # noqa
            kernels_us = kernel_us(call, reps=10, name_chars=40)
            print(f"t={t} {label}: " + ", ".join(f"{k} {v:.1f}" for k, v in kernels_us.items()), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="TP8 tree t in {1, 17, 64, 512}, no peer, no EP8")
    ap.add_argument("--profile", default="", help="comma-separated t: only per-launch device times (TP8 tree)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    if args.profile:
        profile(dev, [int(t) for t in args.profile.split(",")])
        return
    tp8 = make_experts(E, 256, dev)
    print(f"v3 cubin: {kernels(dev).where}")
    checked = check(tp8, dev)
    print(f"check TP8 t=16: v3 rel err {checked['v3_rel_err']:.2e}, v2c {checked['v2c_rel_err']:.2e}, "
          f"v3 vs v2c {checked['v3_vs_v2c_rel']:.2e}")
    dense = None if args.quick else dense_operands(tp8)
    rows = []
    # t = 17 and 33: the verify of a 16- and a 32-node tree (nodes + the root)
    for t in ([1, 9, 17, 64, 257, 512] if args.quick else [1, 8, 9, 16, 17, 33, 64, 129, 256, 257, 512, 1024]):
        for routing in (("tree",) if args.quick else ("tree", "uniform")):
            rows.append(bench_shape(f"k26_tp8_t{t}", t, routing, tp8, 0, dev, dense))
            r = rows[-1]
            print(f"{r['shape']} {routing}: v3 {r['v3_us']:.1f} us ({r['v3_fraction']:.2f}), mma.sync "
                  f"{r['v3_mma_us']:.1f} us, wgmma {r.get('v3_wg_us', float('nan')):.1f} us, one launch "
                  f"{r.get('v3_one_us', float('nan')):.1f} us, with L2 prefetch "
                  f"{r['v3_pf_us']:.1f} us ({r['v3_pf_fraction']:.2f}), "
                  f"late down {r['v3_late_w8_us']:.1f} / {r['v3_late_w16_us']:.1f} us (8 / 16 warps), "
                  f"early down with 8 warps {r['v3_early_w8_us']:.1f} us, "
                  f"v2c {r['v2c_us']:.1f} us "
                  f"({r['v2c_fraction']:.2f})", flush=True)
    del tp8, dense
    torch.cuda.empty_cache()
    if not args.quick:
        ep8 = make_experts(48, 2048, dev)
        dense = dense_operands(ep8)
        for t in (1, 16, 64):
            rows.append(bench_shape(f"k26_ep8_t{t}", t, "tree", ep8, 48 * 3, dev, dense))
    path = write_result("moe_w4a16_v3", rows, extra={"check": checked, "cubin": kernels(dev).where},
                        out_dir=args.out)
    plot(rows, Path(path).with_suffix(".png"))
    print(f"wrote {path}")
    print_table(rows, ["shape", "routing", "experts_touched", "roofline_us", "v3_us", "v3_fraction", "v3_mma_us",
                       "v3_mma_fraction", "v3_wg_us", "v3_wg_fraction", "v3_pf_us",
                       "v3_pf_fraction", "v3_late_w8_us", "v3_late_w16_us", "v3_early_w8_us", "v2c_us",
                       "v2c_fraction", "bf16_grouped_mm_us"])


if __name__ == "__main__":
    main()
