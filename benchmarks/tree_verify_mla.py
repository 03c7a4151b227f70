"""tree_verify_mla on the GPU: the Triton split-KV kernel against the torch absorbed reference and
HF-style decompressed K/V + SDPA with a tree mask, in one run.

    python3 benchmarks/tree_verify_mla.py [--quick] [--no-sweep] [--shapes HxNxL,...] [--out DIR]

Shapes (issue 4): b = 1, h = 8, N in {1, 2, 4, 8}, L in {32K, 128K}; h = 8, N = 64; h = 64, N = 64;
h = 16, N = 256; h = 128, N = 8 (L = 32768); one b = 8 row.  Every request has cache_lens = L = l_max
and a random tree of N nodes; bf16, d_qk = 576, d_v = 512.
Minimal bytes = b * (L * 576 + N * h * 576 + N * h * 512 + N * 576) * 2 (+ lse, mask); flops =
2 * b * N * h * L * (576 + 512); roofline = max(bytes / the GPU's copy rate, flops / 687 TFLOP/s).

Timing: the kernel runs R times in one CUDA graph, each call on its own cache buffer (R caches
together are several times the L2, so every call reads HBM), µs = replay median / R; this is how the
runtime calls it (61 layers back to back in a graph).  Peers are timed one call at a time with
triton's do_bench (L2 flushed between calls); a peer that runs out of memory is reported as "oom".
The sweep (off with --quick / --no-sweep; SWEEP_BUDGET_S at most) times the candidate variants of
NOTES.md side by side (tile config, split count, PDL on/off) on h = 8 with N = 1 (32K and 128K), 4, 8
and on h = 64, N = 64, checks each variant's output first, and prints every variant's µs and the
winner per shape, for the config table in launcher.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (BF16_FLOPS_PER_S, hbm_bytes_per_s, print_table, roofline_us, time_us,  # noqa: E402
                               write_result)
from plugins.common.bitmask import unpack_mask  # noqa: E402
from plugins.common.device import device_facts  # noqa: E402
from plugins.tree_verify_mla.launcher import (  # noqa: E402
    WGMMA_CONFIG,
    Config,
    plan,
    tree_verify_mla_triton,
    workspace_numel,
)
from plugins.tree_verify_mla.reference import tree_verify_mla_reference  # noqa: E402

D_QK, D_V, D_NOPE, D_ROPE = 576, 512, 128, 64  # latent row; per-head decompressed dims for the SDPA peer
SHAPES = [  # (b, h, N, L)
    (1, 8, 1, 4096), (1, 8, 17, 4096), (1, 8, 9, 4096),  # the K2.6 rank's 4K AR step, DDTree-16 and -8 rounds
    (1, 8, 33, 4096), (1, 8, 17, 32768),  # DDTree-32 at 4K, DDTree-16 at 32K
    (1, 8, 1, 32768), (1, 8, 2, 32768), (1, 8, 4, 32768), (1, 8, 8, 32768),
    (1, 8, 1, 131072), (1, 8, 2, 131072), (1, 8, 4, 131072), (1, 8, 8, 131072),
    (1, 8, 64, 32768), (1, 64, 64, 32768), (1, 16, 256, 32768), (1, 128, 8, 32768), (8, 8, 8, 32768),
]
# Sweep: per shape, variants (config, split count or None = the plan's, pdl) timed side by side; the
# first entry of each shape is the table's choice (launcher.CONFIGS_16BIT), the rest the candidates of
# NOTES.md ("Predictions, round 2"), most likely first, so a cut-short sweep still answers.
KM16 = Config(16, 64, 4, 2, keys_m=True)
KM32 = Config(32, 64, 4, 2, keys_m=True)
X2 = Config(16, 32, 4, 3, ctas_per_sm=2)
DV2_64 = Config(64, 64, 4, 2, dv_split=2)
DV2_32 = Config(64, 32, 4, 3, dv_split=2)
W8_64 = Config(64, 64, 8, 2)
WG = WGMMA_CONFIG  # the CUDA C split kernel (tree_verify_wgmma.cu): scores once a 64-row block, two warpgroups
SWEEP = {
    # 4K (first: the K2.6 rank profile of 2026-12-04 has split + combine at ~17 µs a layer for 4.7 MB at N = 1,
    # ~34 µs at N = 17): without PDL the combine's own time shows; fewer splits shorten the combine
    # (2026-12-04: each key tile costs a program ~1.9 us in series (16 -> 32 -> 64 splits: 24.7 -> 17.3 -> 13.3 us);
    # one tile per split: 129 splits 9.85 us, 64-key tiles x 65 splits 9.69 us; the plan now takes 129; N = 17:
    # 22 splits 18.1 us against the partial cap's 13 at 21.7 us, the plan now takes 22 (launcher.L2_SHARE))
    (1, 8, 1, 4096): [(X2, None, True), (X2, 64, True), (X2, 65, True), (X2, 96, True),
                      (Config(16, 16, 4, 3, ctas_per_sm=2), 257, True), (Config(16, 64, 4, 2), 65, True),
                      (X2, None, False), (X2, 32, True), (KM16, None, True)],
    # N = 17 (m = 136): the dv2 table choice pads to 3 x 64 rows (192) and is latency-bound per tile (~2 us a 32-key
    # tile, 6 tiles a split); predicted (2026-12-05, before running): keys_m 32-row blocks (5 m-blocks, 64-key
    # tiles, ~2.5 tiles a split) ~8 us, 16-row x2 blocks (9 m-blocks, ~29 splits) ~11 us, against 18.1 us
    (1, 8, 17, 4096): [(DV2_32, None, True), (WG, None, True), (WG, 44, True), (WG, 33, True),
                       (KM32, None, True), (X2, None, True), (KM16, None, True),
                       (DV2_32, 13, True), (DV2_32, 33, True), (DV2_32, 44, True),
                       (DV2_32, 65, True), (DV2_32, None, False), (DV2_32, 8, True)],
    (1, 8, 9, 4096): [(DV2_32, None, True), (WG, None, True), (WG, 66, True), (KM32, None, True), (X2, None, True),
                      (KM16, None, True)],  # budget 8
    # budget 32 at 4K (m = 264: 5 x 64 rows), budget 16 at 32K (the K2.6 rank's DDTree-16 round: +53 us a layer over
    # 4K, H200 k26-rank.json): the N = 17 candidates, and 64-row blocks without the value split (scores once)
    (1, 8, 33, 4096): [(DV2_32, None, True), (WG, None, True), (WG, 26, True), (KM32, None, True), (X2, None, True),
                       (W8_64, None, True), (Config(64, 32, 8, 3), None, True)],
    (1, 8, 17, 32768): [(DV2_32, None, True), (WG, None, True), (WG, 66, True), (KM32, None, True), (X2, None, True),
                        (W8_64, None, True), (Config(64, 32, 8, 3), None, True), (KM16, None, True),
                        (DV2_32, 44, True)],
    (1, 8, 1, 32768): [(X2, None, True), (KM16, None, True), (X2, None, False), (Config(16, 32, 4, 4), None, True),
                       (Config(16, 64, 4, 3), None, True), (Config(16, 32, 4, 2, ctas_per_sm=3), None, True),
                       (Config(16, 64, 4, 2, ctas_per_sm=2), None, True), (X2, 132, True), (KM16, 264, True)],
    (1, 8, 1, 131072): [(X2, None, True), (KM16, None, True), (Config(16, 32, 4, 4), None, True),
                        (Config(16, 32, 4, 2, ctas_per_sm=3), None, True)],
    (1, 8, 8, 32768): [(DV2_32, None, True), (WG, None, True), (DV2_64, None, True), (DV2_32, 132, True),
                       (DV2_32, 33, True), (Config(64, 32, 8, 3), 132, True), (X2, None, True), (KM16, None, True),
                       (KM32, None, True), (DV2_32, None, False)],
    (1, 8, 4, 32768): [(KM32, None, True), (X2, None, True), (Config(32, 32, 8, 4), None, True),
                       (DV2_32, None, True)],
    (1, 64, 64, 32768): [(W8_64, None, True), (WG, None, True), (DV2_32, None, True), (W8_64, 4, True),
                         (Config(64, 32, 8, 3), None, True)],
    # m = 512: where the table switches to W8_64?
    (1, 8, 64, 32768): [(DV2_32, None, True), (WG, None, True), (W8_64, None, True)],
}
SWEEP_BUDGET_S = float(os.environ.get("SWEEP_BUDGET_S", 150))  # stop sweeping past this many seconds of the sweep
RUN_BUDGET_S = float(os.environ.get("RUN_BUDGET_S", 215))  # ... or of the whole run (device_run.sh kills it at 240 s)


def random_tree(b: int, n: int, g: torch.Generator) -> torch.Tensor:
    """[b, n, w] int64 ancestor mask of random trees (parent of node i uniform in [0, i))."""
    from plugins.common.bitmask import pack_mask
    anc = torch.zeros(b, n, n, dtype=torch.bool)
    for i in range(n):
        if i:
            parent = torch.randint(0, i, (b,), generator=g)
            anc[:, i] = anc[torch.arange(b), parent]
        anc[:, i, i] = True
    return pack_mask(anc).to("cuda")


class Case:
    """Inputs of one shape: R caches (rotated), q, tree rows and mask, outputs, workspace."""

    def __init__(self, b: int, h: int, n: int, l_len: int, reps: int):
        g = torch.Generator().manual_seed(b * 1000003 + h * 1009 + n * 31 + l_len)
        gd = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31, (1,), generator=g)))
        self.b, self.h, self.n, self.l = b, h, n, l_len
        self.caches = [torch.randn(b, l_len, D_QK, device="cuda", generator=gd).bfloat16() for _ in range(reps)]
        self.q = torch.randn(b, n, h, D_QK, device="cuda", generator=gd).bfloat16()  # [b, n, h, d_qk]
        self.tree_kv = torch.randn(b, n, D_QK, device="cuda", generator=gd).bfloat16()  # [b, n, d_qk]
        self.mask = random_tree(b, n, g)  # [b, n, w]
        self.lens = torch.full((b,), l_len, dtype=torch.int32, device="cuda")  # [b]
        self.scale = D_QK ** -0.5
        self.out = torch.empty(b, n, h, D_V, dtype=torch.bfloat16, device="cuda")  # [b, n, h, d_v]
        self.lse = torch.empty(b, n, h, dtype=torch.float32, device="cuda")  # [b, n, h]

    def args(self, k: int = 0):
        return (self.q, self.caches[k], self.lens, self.tree_kv, self.mask, self.scale, self.out, self.lse)

    def kernel_us(self, config: Config | None = None, num_splits: int | None = None, pdl: bool | None = None) -> float:
        ws = torch.empty(workspace_numel(self.b, self.n, self.h, D_V, self.l, torch.bfloat16, self.q.device, config,
                                         num_splits), device="cuda")

        def run():
            for k in range(len(self.caches)):
                tree_verify_mla_triton(*self.args(k), workspace=ws, config=config, num_splits=num_splits, pdl=pdl)
        return time_us(run, graph=True) / len(self.caches)

    def check_variant(self, config: Config, num_splits: int | None, pdl: bool) -> float:
        """‖out - ref‖ / ‖ref‖ of one call of a sweep variant (a wrong variant must not win)."""
        self.out.fill_(float("nan"))
        tree_verify_mla_triton(*self.args(), config=config, num_splits=num_splits, pdl=pdl)
        ref_out = torch.empty(self.out.shape, dtype=torch.float32, device="cuda")
        tree_verify_mla_reference(*self.args()[:6], ref_out, torch.empty_like(self.lse))
        return float((self.out.float() - ref_out).norm() / ref_out.norm())

    def check(self) -> float:
        """‖out - ref‖ / ‖ref‖ of one kernel call against the reference (fp32) on the first cache."""
        tree_verify_mla_triton(*self.args())
        ref_out = torch.empty(self.out.shape, dtype=torch.float32, device="cuda")
        ref_lse = torch.empty_like(self.lse)
        tree_verify_mla_reference(*self.args()[:6], ref_out, ref_lse)
        return float((self.out.float() - ref_out).norm() / ref_out.norm())

    def reference_us(self) -> float:
        ref_out = torch.empty(self.out.shape, dtype=torch.float32, device="cuda")
        return time_us(lambda: tree_verify_mla_reference(*self.args()[:6], ref_out, self.lse), warmup_ms=5, rep_ms=30)

    def sdpa_us(self) -> float:
        """HF-style: decompress k = [c_kv W_UK | k_pe], v = c_kv W_UV per head, SDPA with a boolean tree mask."""
        b, h, n, l_len = self.b, self.h, self.n, self.l
        g = torch.Generator(device="cuda").manual_seed(5)
        w_uk = (torch.randn(D_V, h * D_NOPE, device="cuda", generator=g) * D_V ** -0.5).bfloat16()  # [512, h*128]
        w_uv = (torch.randn(D_V, h * D_NOPE, device="cuda", generator=g) * D_V ** -0.5).bfloat16()  # [512, h*128]
        q = torch.randn(b, h, n, D_NOPE + D_ROPE, device="cuda", generator=g).bfloat16()  # [b, h, n, 192]
        visible = torch.cat([torch.ones(b, n, l_len, dtype=torch.bool, device="cuda"),
                             unpack_mask(self.mask, n)], dim=-1)[:, None]  # [b, 1, n, l + n]
        cache = self.caches[0]

        def run():
            rows = torch.cat([cache, self.tree_kv], dim=1)  # [b, l + n, 576]
            c_kv, k_pe = rows[..., :D_V], rows[..., D_V:]
            k_nope = (c_kv @ w_uk).view(b, l_len + n, h, D_NOPE)  # [b, l + n, h, 128]
            k = torch.cat([k_nope, k_pe[:, :, None, :].expand(b, l_len + n, h, D_ROPE)], dim=-1).transpose(1, 2)
            v = (c_kv @ w_uv).view(b, l_len + n, h, D_NOPE).transpose(1, 2)  # [b, h, l + n, 128]
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible,
                                                                    scale=(D_NOPE + D_ROPE) ** -0.5)
        return time_us(run, warmup_ms=5, rep_ms=30)


def peer(fn) -> float | str:
    try:
        return round(fn(), 1)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return "oom"
    except RuntimeError as e:  # a backend refusing the shape: report, keep the run going
        return f"error: {str(e)[:60]}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer shapes, no sweep")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--shapes", default="", help="only these b = 1 shapes, as HxNxL (e.g. 8x17x4096,8x17x32768)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    only = {tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s}
    shapes = [s for s in SHAPES if (not args.quick or s[3] == 32768) and (not only or (s[0] == 1 and s[1:] in only))]
    sms = device_facts("cuda").sms
    rows, sweeps, t_start = [], {}, time.time()
    for b, h, n, l_len in shapes:
        cache_bytes = b * l_len * D_QK * 2
        reps = max(2, min(8, int(400e6 // cache_bytes)))  # R caches together >= ~300 MB, several L2s
        c = Case(b, h, n, l_len, reps)
        err = c.check()
        us = c.kernel_us()
        p = plan(b, n, h, l_len, torch.bfloat16, "cuda")
        moved = b * (l_len * D_QK + n * h * D_QK + n * h * D_V + n * D_QK) * 2 + b * n * h * 4 + c.mask.numel() * 8
        flops = 2 * b * n * h * l_len * (D_QK + D_V)
        roof = roofline_us(moved, flops)
        row = dict(b=b, h=h, N=n, L=l_len, us=round(us, 2), roofline_us=round(roof, 2),
                   roofline_fraction=round(roof / us, 3),
                   bound="memory" if moved / hbm_bytes_per_s() > flops / BF16_FLOPS_PER_S else "compute",
                   gb_per_s=round(moved / us / 1e3, 1), tflop_per_s=round(flops / us / 1e6, 1),
                   bytes=moved, flops=flops, splits=p.num_splits, config=p.config.tag(), out_rel_err=err,
                   peer_torch_reference_us=peer(c.reference_us), peer_sdpa_decompressed_us=peer(c.sdpa_us))
        rows.append(row)
        del c
        torch.cuda.empty_cache()
    t_sweep = time.time()
    for (b, h, n, l_len), variants_in in SWEEP.items():  # after the table rows, within a time budget
        row = next((r for r in rows if (r["b"], r["h"], r["N"], r["L"]) == (b, h, n, l_len)), None)
        if args.quick or args.no_sweep or row is None:
            continue
        c = Case(b, h, n, l_len, max(2, min(8, int(400e6 // (b * l_len * D_QK * 2)))))
        variants = {}
        for cfg, s, pdl in variants_in:
            key = f"{cfg.tag()}-splits{s or plan(b, n, h, l_len, torch.bfloat16, 'cuda', cfg).num_splits}" \
                  + ("" if pdl else "-nopdl")
            if time.time() - t_sweep > SWEEP_BUDGET_S or time.time() - t_start > RUN_BUDGET_S:
                variants["cut_short"] = f"over the {SWEEP_BUDGET_S} s sweep / {RUN_BUDGET_S} s run budget"
                break
            try:
                err = c.check_variant(cfg, s, pdl)
                variants[key] = round(c.kernel_us(cfg, s, pdl), 2) if err < 2e-2 else f"wrong: rel err {err:.3g}"
            except Exception as e:  # out of shared memory / registers: report, go on
                variants[key] = f"fail: {type(e).__name__}: {str(e)[:80]}"
            print(f"  sweep b{b}-h{h}-N{n}-L{l_len} {key}: {variants[key]}", flush=True)
        timed = {k: v for k, v in variants.items() if isinstance(v, float)}
        best = min(timed, key=timed.get) if timed else None
        row["variants_us"] = variants
        row["best_variant"] = best
        sweeps[f"b{b}-h{h}-N{n}-L{l_len}"] = (best, timed.get(best), row["roofline_us"], variants)
        del c
        torch.cuda.empty_cache()
    path = write_result("tree_verify_mla", rows, extra=dict(
        d_qk=D_QK, d_v=D_V, sms=sms, timing="kernel: CUDA-graph replay of R calls on R caches, median / R; "
        "peers: do_bench median, L2 flushed", seconds=round(time.time() - t_start, 1)), out_dir=args.out)
    print(f"wrote {path} in {time.time() - t_start:.0f} s")
    for shape, (best, best_us, roof, variants) in sweeps.items():  # the table to paste into NOTES.md
        print(f"sweep {shape} (roofline {roof} us): " + ", ".join(
            f"{k} {v if isinstance(v, str) else f'{v} us ({roof / v:.0%})'}" for k, v in variants.items()))
        print(f"  winner {shape}: {best} {best_us} us ({roof / best_us:.1%} of roofline)" if best else
              f"  winner {shape}: every variant failed")
    print_table(rows, ["b", "h", "N", "L", "us", "roofline_us", "roofline_fraction", "bound", "gb_per_s",
                       "tflop_per_s", "splits", "out_rel_err", "peer_torch_reference_us", "peer_sdpa_decompressed_us"])


if __name__ == "__main__":
    main()
