"""plugins/skinny_gemm against cuBLAS on one K2.6 TP8 rank's decode GEMMs (issue 15's largest class: the AR step's
GEMMs at 45 % of their roofline, benchmarks/results/k26-rank.json).

Per shape and token count t, each way is a CUDA graph of one call per weight copy (copies >= 256 MB: every call
reads its weights from HBM, as in a round), median replay / calls:
  cublas      runtime.model.layers.linear with the switch off (F.linear, or aten::mm.dtype for fp32 outputs)
  skinny      kdtree::skinny_gemm's kernel with its plan (launch.plan), pf = 0
  skinny_pf   the same with pf = 1 (each CTA prefetches its weights into L2 before its PDL wait; the op's default
              where the plan splits k: launch.PREFETCH)
  skinny_frag (t <= 8) the same plan on the weights in fragment order (plugins/skinny_gemm/fragment_order.py: each
              warp load 512 contiguous bytes), pf = 0; the same bits (checked)
  skinny_rg1  (t > 8) the plan with one row group per CTA forced (launch.ROW_GROUP_PAIRS off), pf = 0
  skinny_tt4  (t 17..24) the plan before three-tile variants: 4 token tiles, one row group (run as 25 tokens), pf = 0
  wgmma       (sm_90, k % 64 == 0) skinny_wgmma.cu with its plan (wgmma_launch.plan): weights as wgmma's M side, TMA
  sweep       (unless --quick) other warps / k splits / blocks in flight, the best reported with its config
Every skinny result is checked against the fp32-accumulated product first (bf16 rounding, or 1e-5 for fp32).
Prints a table; writes OUT/skinny-gemm.json.
    python3 benchmarks/skinny_gemm.py --out DIR [--quick] [--tokens 1,8,16,17,32]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import print_table, roofline_us, time_us, write_result  # noqa: E402

# name -> (n, k, out): one TP8 rank of K2.6 (qkv_a joint, q_b, o_proj, router + shared gate_up joint (fp32 out),
# shared down (unfolded form), layer 0's dense MLP, the lm_head slice)
SHAPES = {"qkv_a": (2112, 7168, "bf16"), "q_b": (1536, 1536, "bf16"), "o_proj": (7168, 1024, "bf16"),
          "router_gate_up": (896, 7168, "fp32"), "shared_down": (7168, 256, "bf16"),
          "dense_gate_up": (4608, 7168, "bf16"), "dense_down": (7168, 2304, "bf16"),
          "lm_head": (20480, 7168, "fp32")}


def _sweep(t: int, n: int, k: int, sms: int) -> list[dict]:
    """Alternatives to the plan's (warps, splits, u): halved / doubled warps and splits, the shallower U (of the
    plan's row groups per CTA)."""
    from plugins.skinny_gemm.launch import MAX_WARPS, U_VARIANTS, row_groups_per_cta, split_shape, token_tiles
    w, ks = split_shape(n, k, sms)
    out = []
    for ww in {max(1, w // 2), w, min(MAX_WARPS, w * 2)}:
        for kk in {max(1, ks // 2), ks, ks * 2, ks * 4}:
            if (ww, kk) != (w, ks) and k // 32 >= kk:
                out.append({"warps": ww, "splits": kk})
    rg = row_groups_per_cta(t, n, k, sms)
    out += [{"warps": w, "splits": ks, "u": u, "row_groups": rg}
            for u in U_VARIANTS[token_tiles(t), rg][1:]]  # shallower register rings
    return out


def main() -> None:
    import torch

    from plugins.common.device import device_facts
    from plugins.skinny_gemm import wgmma_launch
    from plugins.skinny_gemm.fragment_order import to_fragment_order
    from plugins.skinny_gemm.launch import plan, skinny_gemm_cuda, skinny_gemm_frag_cuda
    from runtime.model import layers

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="no sweep; t = 1, 16, 17")
    ap.add_argument("--tokens", default=None)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    a = ap.parse_args()
    tokens = [int(v) for v in (a.tokens or ("1,16,17" if a.quick else "1,2,4,8,16,17,32")).split(",")]
    layers.SKINNY_GEMM = False  # the peer: linear's cuBLAS path
    dev = torch.device("cuda")
    sms = device_facts(dev).sms
    torch.manual_seed(0)
    rows = []
    for name in a.shapes.split(","):
        n, k, out = SHAPES[name]
        f32 = out == "fp32"
        nbytes = n * k * 2
        copies = max(8, -(-(256 << 20) // nbytes))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
        for t in tokens:
            x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ ws[0].float().t()
            got = skinny_gemm_cuda(x, ws[0], None, f32)
            err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
            assert err < (3e-5 if f32 else 1e-2), (name, t, err)  # fp32 sums in another order: lm_head 1.0e-5
            od = torch.float32 if f32 else torch.bfloat16

            def run(fn):
                return time_us(lambda: [fn(w) for w in ws], graph=True) / copies

            def run_pairs(fn):  # fn(i) on copy i
                return time_us(lambda: [fn(i) for i in range(copies)], graph=True) / copies

            us = {"cublas": run(lambda w: layers.linear(x, w, out_dtype=od)),
                  "skinny": run(lambda w: skinny_gemm_cuda(x, w, None, f32, pf=False)),
                  "skinny_pf": run(lambda w: skinny_gemm_cuda(x, w, None, f32, pf=True))}
            if k % wgmma_launch.BLOCK_K == 0 and wgmma_launch.available(dev):  # skinny_wgmma.cu (sm_90)
                got_w = wgmma_launch.skinny_wgmma(x, ws[0], None, f32)
                err_w = ((got_w.float() - ref).abs().max() / ref.abs().max()).item()
                assert err_w < (3e-5 if f32 else 1e-2), (name, t, "wgmma", err_w)
                us["wgmma"] = run(lambda w: wgmma_launch.skinny_wgmma(x, w, None, f32, boxes=1))
                got_w = wgmma_launch.skinny_wgmma(x, ws[0], None, f32, boxes=4)  # four boxes a stage
                err_w = ((got_w.float() - ref).abs().max() / ref.abs().max()).item()
                assert err_w < (3e-5 if f32 else 1e-2), (name, t, "wgmma_kb4", err_w)
                us["wgmma_kb4"] = run(lambda w: wgmma_launch.skinny_wgmma(x, w, None, f32, boxes=4))
            if t <= 8:  # the fragment-order kernel: a copy of each weight in its layout
                wfs = [to_fragment_order(w) for w in ws]
                assert torch.equal(skinny_gemm_frag_cuda(x, wfs[0], n, None, f32, pf=False), got), (name, t, "frag")
                us["skinny_frag"] = run_pairs(lambda i: skinny_gemm_frag_cuda(x, wfs[i], n, None, f32, pf=False))
                del wfs
            if t > 8:
                us["skinny_rg1"] = run(lambda w: skinny_gemm_cuda(x, w, None, f32, pf=False, row_groups=1))
            if 17 <= t <= 24:
                x25 = torch.cat([x, x[:25 - t]])  # [25, k]
                us["skinny_tt4"] = run(lambda w: skinny_gemm_cuda(x25, w, None, f32, pf=False, row_groups=1))
            best = None
            if not a.quick:
                for cfg in _sweep(t, n, k, sms):
                    try:
                        plan(t, n, k, f32, False, sms, **cfg)
                    except ValueError:  # more split partials than the workspace holds
                        continue
                    for pf in (False, True):
                        v = run(lambda w, cfg=cfg, pf=pf: skinny_gemm_cuda(x, w, None, f32, pf=pf, **cfg))
                        if best is None or v < best[1]:
                            best = ({**cfg, "pf": pf}, v)
            p = plan(t, n, k, f32, False, sms)
            roof = roofline_us(nbytes + t * k * 2 + t * n * (4 if f32 else 2))
            row = {"shape": name, "n": n, "k": k, "t": t, "out": out, "bytes": nbytes, "roofline_us": round(roof, 2),
                   "plan": {"kernel": p.kernel, "warps": p.warps, "splits": p.splits, "row_groups": p.row_groups,
                            "ctas": p.grid[0] * p.grid[1]},
                   "rel_err": err, "copies": copies}
            for key, v in us.items():
                row[f"{key}_us"], row[f"{key}_fraction"] = round(v, 2), round(roof / v, 3)
            if best is not None:
                row["sweep_best"], row["sweep_best_us"] = best[0], round(best[1], 2)
                row["sweep_best_fraction"] = round(roof / best[1], 3)
            row["speedup_vs_cublas"] = round(us["cublas"] / min(us["skinny"], us["skinny_pf"]), 3)
            rows.append(row)
            print(row, flush=True)
        ws.clear()
    extra = {"timing": "CUDA graph of one call per weight copy (>= 256 MB of copies: HBM reads), median replay / "
             "calls", "peer": "cuBLAS through runtime.model.layers.linear (KDTREE_SKINNY_GEMM off)",
             "sms": sms}
    path = write_result("skinny-gemm", rows, extra, a.out)
    print(f"wrote {path}")
    print_table(rows, ["shape", "t", "roofline_us", "cublas_us", "skinny_us", "skinny_frag_us", "wgmma_us",
                       "wgmma_kb4_us", "skinny_pf_us", "skinny_rg1_us", "skinny_tt4_us", "sweep_best_us",
                       "cublas_fraction", "skinny_fraction", "skinny_pf_fraction", "speedup_vs_cublas"])


if __name__ == "__main__":
    main()
