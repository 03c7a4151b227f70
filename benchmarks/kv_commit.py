"""kv_commit on the GPU: the Triton compaction (61 layers, d_qk 576, bf16, plus the drafter features)
against the torch reference on CUDA.

    python3 benchmarks/kv_commit.py [--quick] [--out DIR]

Shapes: y = 61 layers, d_qk = 576 bf16, feats f = 6 * 7168 bf16, b in {1, 8, 64}, every request
accepting L in 1..8 rows (a = 8).  Bytes moved per call = b * L * (y * d_qk + f) * 2 B read and the
same written (+ indices); roofline = bytes / the GPU's measured copy rate.  Goal (issue 4): >= 80 % of that roofline.

Timing: one CUDA graph holds a cache_lens reset and K = 32 commits, each reading different scratch /
feats rows (so the rows come from HBM, not L2) and appending at the advancing cache_lens; µs per
commit = replay / K.  The peer (not capturable: boolean-mask indexing syncs) is timed directly, cycling
through the same K index sets.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import print_table, roofline_us, time_us, write_result  # noqa: E402
from plugins.kv_commit import kv_commit  # noqa: E402
from plugins.kv_commit.kernel import kv_commit_triton  # noqa: E402
from plugins.kv_commit.reference import kv_commit_reference  # noqa: E402

Y, D, F, A, K = 61, 576, 6 * 7168, 8, 32


class Setup:
    """Buffers for b requests: scratch/feats of n = K * A nodes, a cache with room for K commits."""

    def __init__(self, b: int, feats: bool):
        g = torch.Generator(device="cuda").manual_seed(b)
        n, l_max = K * A, K * A + 16
        self.b = b
        self.scratch = torch.randn(Y, b, n, D, device="cuda", generator=g).bfloat16()  # [y, b, n, d_qk]
        self.cache = torch.randn(Y, b, l_max, D, device="cuda", generator=g).bfloat16()  # [y, b, l_max, d_qk]
        self.feats = torch.randn(b, n, F, device="cuda", generator=g).bfloat16() if feats else None  # [b, n, f]
        self.ctx = torch.zeros(b, A, F, device="cuda").bfloat16() if feats else None  # [b, a, f]
        self.lens0 = torch.randint(0, 16, (b,), dtype=torch.int32, device="cuda", generator=g)
        self.lens = self.lens0.clone()
        perm = torch.stack([torch.randperm(n, device="cuda", generator=g) for _ in range(b)])  # [b, n]
        self.idx = [perm[:, k * A:(k + 1) * A].to(torch.int32).contiguous() for k in range(K)]  # K x [b, a]
        self.alen = torch.zeros(b, dtype=torch.int32, device="cuda")

    def commits(self, fn, **kw):
        def run():
            self.lens.copy_(self.lens0)
            for k in range(K):
                fn(self.cache, self.lens, self.scratch, self.idx[k], self.alen, self.feats, self.ctx, **kw)
        return run

    def check(self) -> bool:
        """One commit by the op against the reference on clones (bitwise)."""
        self.lens.copy_(self.lens0)
        ref = [t.clone() if t is not None else None for t in (self.cache, self.lens)]
        ctx_ref = self.ctx.clone() if self.ctx is not None else None
        kv_commit(self.cache, self.lens, self.scratch, self.idx[0], self.alen, self.feats, self.ctx)
        kv_commit_reference(ref[0], ref[1], self.scratch, self.idx[0], self.alen, self.feats, ctx_ref)
        ok = torch.equal(self.cache, ref[0]) and torch.equal(self.lens, ref[1])
        return ok and (ctx_ref is None or torch.equal(self.ctx, ctx_ref))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lengths = (1, 4, 8) if args.quick else tuple(range(1, A + 1))
    rows, t_start = [], time.time()
    for b in (1, 8, 64):
        for with_feats in ((True,) if args.quick or b != 64 else (True, False)):
            s = Setup(b, with_feats)
            for length in lengths:
                s.alen.fill_(length)
                exact = s.check()
                us = time_us(s.commits(kv_commit), graph=True) / K
                variants = {}
                if not args.quick and b == 64 and length in (1, A):  # tile sweep: full and mostly-idle grids
                    for lch, fb, nw in ((4, 4096, 4), (8, 4096, 4), (16, 4096, 4), (8, 2048, 4), (8, 8192, 8),
                                        (16, 8192, 8)):
                        variants[f"LCH{lch}-FB{fb}-w{nw}"] = round(time_us(s.commits(
                            kv_commit_triton, layers_per_program=lch, feats_per_program=fb, num_warps=nw),
                            graph=True) / K, 2)
                state = {"k": 0}

                def peer(s: Setup = s) -> None:  # binds this setup (the loop's `s` is deleted after it)
                    if state["k"] == 0:
                        s.lens.copy_(s.lens0)
                    kv_commit_reference(s.cache, s.lens, s.scratch, s.idx[state["k"]], s.alen, s.feats, s.ctx)
                    state["k"] = (state["k"] + 1) % K

                peer_us = time_us(peer, warmup_ms=10, rep_ms=60)
                row_bytes = Y * D * 2 + (F * 2 if with_feats else 0)
                moved = 2 * b * length * row_bytes + b * (A * 4 + 4 + 4 + 4)
                roof = roofline_us(moved)
                rows.append(dict(b=b, L=length, feats=with_feats, exact=exact, us=round(us, 2),
                                 roofline_us=round(roof, 2), roofline_fraction=round(roof / us, 3),
                                 meets_goal=roof / us >= 0.8,
                                 gb_per_s=round(moved / us / 1e3, 1), bytes=moved, variants_us=variants,
                                 peer_torch_reference_us=round(peer_us, 1),
                                 speedup_vs_reference=round(peer_us / us, 1)))
            del s
            torch.cuda.empty_cache()
    path = write_result("kv_commit", rows, extra=dict(y=Y, d_qk=D, f=F, a=A, commits_per_graph=K,
                                                      timing="CUDA-graph replay of K commits, median / K",
                                                      seconds=round(time.time() - t_start, 1)), out_dir=args.out)
    print(f"wrote {path}")
    print_table(rows, ["b", "L", "feats", "exact", "us", "roofline_us", "roofline_fraction", "meets_goal", "gb_per_s",
                       "peer_torch_reference_us", "variants_us"])


if __name__ == "__main__":
    main()
