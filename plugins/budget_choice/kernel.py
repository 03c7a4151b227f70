"""Triton kernels of budget auto's choice and calibration: reference.py's select and observe, one program
each (a round's b x N scores and nb <= 16 buckets fit one program), so a captured round spends two launches
on them instead of ~50 small torch kernels.  Sums run in another order than the reference's (fp32 rounding
differs in the last bits; a pick can differ only at an exact tie of expected tokens per µs)."""

from __future__ import annotations

import triton
import triton.language as tl

from plugins.common.keys import max_combine

NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _gather(vals, rj, idx):
    """vals [BNB] at positions idx [BNB] (a one-hot sum: nb is small)."""
    return tl.sum(tl.where(rj[None, :] == idx[:, None], vals[None, :], 0.0), axis=1)


@triton.jit
def select_kernel(scores_ptr, live_ptr, sizes_ptr, seen_ptr, covered_ptr, force_ptr, cap_cost_ptr, value_ptr,
                  hint_ptr, extra_ptr, pick_ptr, hot_ptr, B, N, cap, min_cap, decay, s_min, s_max,
                  NB: tl.constexpr, BB: tl.constexpr, BN: tl.constexpr, BNB: tl.constexpr, FULL: tl.constexpr):
    rb = tl.arange(0, BB)
    rn = tl.arange(0, BN)
    rj = tl.arange(0, BNB)
    bm = rb < B
    jm = rj < NB
    live = tl.load(live_ptr + rb, mask=bm, other=0).to(tl.float32)  # [BB]
    live_sum = tl.sum(live, axis=0)
    # extra[j] = sum over requests of live * (sum of exp(score) over nodes 1 .. sizes[j])
    sc = tl.load(scores_ptr + rb[:, None] * N + 1 + rn[None, :], mask=bm[:, None] & (rn[None, :] < N - 1),
                 other=NEG_INF)  # [BB, BN] nodes 1 .. N - 1
    cum = tl.cumsum(tl.exp(sc), axis=1)  # [BB, BN]
    per_node = tl.sum(cum * live[:, None], axis=0)  # [BN]
    sizes = tl.load(sizes_ptr + rj, mask=jm, other=1)  # [BNB]
    extra = tl.sum(tl.where(rn[None, :] == (sizes[:, None] - 1), per_node[None, :], 0.0), axis=1)  # [BNB]
    tl.store(extra_ptr + rj, extra, mask=jm)
    # the calibration s (reference.calibration)
    seen0 = tl.load(seen_ptr + rj, mask=jm, other=1.0)
    seen1 = tl.load(seen_ptr + NB + rj, mask=jm, other=1.0)
    s = tl.minimum(tl.maximum(seen0 / seen1, s_min), s_max)  # [BNB]
    cov = tl.load(covered_ptr + rj, mask=jm, other=0).to(tl.int32)  # [BNB]
    known = tl.associative_scan(tl.where(cov != 0, rj, 0), 0, max_combine)  # [BNB] cummax
    s_known = _gather(s, rj, known)
    cov_known = _gather(cov.to(tl.float32), rj, known)
    s = tl.where(cov_known != 0.0, s_known, 1.0)
    tokens = live_sum + s * extra  # [BNB] E(b)
    if FULL:
        cc = tl.load(cap_cost_ptr + rj[:, None] * NB + rj[None, :], mask=jm[:, None] & jm[None, :],
                     other=1.0)  # [cap, bucket]
        below = (rj[None, :] <= rj[:, None]) & jm[None, :]
        rate = tl.where(below, tokens[None, :] / cc, -1.0)  # [cap, bucket]
        best = tl.argmax(rate, axis=1)  # [BNB] each cap's pick, the first maximum
        onehot = rj[None, :] == best[:, None]
        got_tok = tl.sum(tl.where(onehot, tokens[None, :], 0.0), axis=1)  # [BNB]
        got_us = tl.sum(tl.where(onehot, cc, 0.0), axis=1)
        chosen = tl.sum(tl.where(rj == NB - 1, best, 0), axis=0)
        w = (live_sum > 0).to(tl.float32)
        v0 = tl.load(value_ptr + rj, mask=jm, other=0.0) * (1 - w * (1 - decay)) + got_tok * w
        v1 = tl.load(value_ptr + NB + rj, mask=jm, other=0.0) * (1 - w * (1 - decay)) + got_us * w
        tl.store(value_ptr + rj, v0, mask=jm)
        tl.store(value_ptr + NB + rj, v1, mask=jm)
        ratio = v0 / tl.maximum(v1, 1e-30)
        ratio = tl.where(rj >= min_cap, ratio, -1.0)
        ratio = tl.where(jm, ratio, NEG_INF)
        top = tl.max(ratio, axis=0)
        tl.store(hint_ptr, tl.max(tl.where(jm & (ratio == top), rj, -1), axis=0).to(tl.int64))  # ties: larger cap
    else:
        cc_row = tl.load(cap_cost_ptr + cap * NB + rj, mask=jm, other=1.0)
        rate = tl.where(jm & (rj <= cap), tokens / cc_row, NEG_INF)
        chosen = tl.argmax(rate, axis=0)
    f = tl.load(force_ptr)
    pick = tl.where(f >= 0, f, chosen.to(tl.int64))
    tl.store(pick_ptr, pick)
    tl.store(hot_ptr + rj, rj == pick, mask=jm)


@triton.jit
def observe_kernel(accept_len_ptr, accept_idx_ptr, sizes_ptr, extra_ptr, seen_ptr, covered_ptr, B, A, verified,
                   decay, NB: tl.constexpr, BB: tl.constexpr, BA: tl.constexpr, BNB: tl.constexpr):
    rb = tl.arange(0, BB)
    ra = tl.arange(0, BA)
    rj = tl.arange(0, BNB)
    bm = rb < B
    jm = rj < NB
    alen = tl.load(accept_len_ptr + rb, mask=bm, other=0)  # [BB]
    idx = tl.load(accept_idx_ptr + rb[:, None] * A + ra[None, :], mask=bm[:, None] & (ra[None, :] < A),
                  other=0)  # [BB, BA]
    on_path = (ra[None, :] >= 1) & (ra[None, :] < alen[:, None])  # [BB, BA]
    sizes = tl.load(sizes_ptr + rj, mask=jm, other=0)  # [BNB]
    got = tl.zeros([BNB], dtype=tl.float32)
    for j in tl.static_range(NB):
        size_j = tl.sum(tl.where(rj == j, sizes, 0), axis=0)
        n_j = tl.sum(tl.sum((on_path & (idx.to(tl.int64) <= size_j)).to(tl.float32), axis=1), axis=0)
        got = tl.where(rj == j, n_j, got)
    any_live = tl.sum(alen, axis=0) > 0
    cover = (sizes <= verified) & any_live & jm  # [BNB]
    old = tl.load(covered_ptr + rj, mask=jm, other=0).to(tl.int32)
    tl.store(covered_ptr + rj, (old != 0) | cover, mask=jm)
    w = cover.to(tl.float32)
    extra = tl.load(extra_ptr + rj, mask=jm, other=0.0)
    s0 = tl.load(seen_ptr + rj, mask=jm, other=0.0)
    s1 = tl.load(seen_ptr + NB + rj, mask=jm, other=0.0)
    tl.store(seen_ptr + rj, s0 * (1 - w * (1 - decay)) + got * w, mask=jm)
    tl.store(seen_ptr + NB + rj, s1 * (1 - w * (1 - decay)) + extra * w, mask=jm)


def next_pow2(n: int) -> int:
    """Block extents: a power of two >= n, at least 2 (every arange a real vector)."""
    return max(2, triton.next_power_of_2(n))


def select_triton(scores, live, sizes, seen, covered, force, cap_cost, value, hint, extra, pick, hot, cap: int,
                  min_cap: int, decay: float, s_min: float, s_max: float) -> None:
    """reference.select_reference's writes by one program (CUDA tensors; CPU ones under TRITON_INTERPRET=1)."""
    b, n = scores.shape
    nb = sizes.shape[0]
    select_kernel[(1,)](scores.contiguous(), live, sizes, seen, covered, force, cap_cost, value, hint, extra, pick,
                        hot, b, n, cap, min_cap, decay, s_min, s_max, NB=nb, BB=next_pow2(b), BN=next_pow2(n - 1),
                        BNB=next_pow2(nb), FULL=cap == nb - 1, num_warps=4)


def observe_triton(accept_len, accept_idx, sizes, verified: int, extra, seen, covered, decay: float) -> None:
    """reference.observe_reference's writes by one program."""
    b, a = accept_idx.shape
    nb = sizes.shape[0]
    observe_kernel[(1,)](accept_len, accept_idx.contiguous(), sizes, extra, seen, covered, b, a, verified, decay,
                         NB=nb, BB=next_pow2(b), BA=next_pow2(a), BNB=next_pow2(nb), num_warps=4)
