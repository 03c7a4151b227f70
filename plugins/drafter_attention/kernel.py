"""Triton kernels of drafter_attention: split-KV flash attention of one request's kv head, and the combine.

Why a kernel: as torch ops the attention was 9 launches per drafter layer (two copies, two batched GEMMs,
scale, mask, softmax, two casts), and cuBLAS picks a small-N GEMV (gemmSN) for the second product whose K is
the whole cache: 43 µs a call on the tiny drafter (benchmarks/results/layer-fusion.json).  Here: 2 launches.

Program (kv head, split, request): the M side is the kv head's rep * s query rows (row m = r * s + t: query head
gi * rep + r, slot t), padded to BLOCK_M; the split's cache rows are its share of [0, min(visible[b], cap)), cut into
SPLITS pieces of whole BLOCK_N tiles on the device (the length changes every round; the launch does not).
Online softmax in fp32 in base 2 (the scale times log2(e) folded into the scores, so the GPU's exp2 takes the
shifted score as it is: base e costs a rounded multiply by log2(e) of every shifted score, which put 2 of 240
fp32 cases past the test's bound on the H200); p rounded to the cache dtype for the value product.
With one split the program writes the normalised output; otherwise the unnormalised accumulator and (max, sum)
per row, which the combine merges.  A split with no row writes max = -inf, sum 0 and a zero accumulator.
Both kernels launch with PDL on sm_90+ (plugins/common/pdl.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plugins.common.device import device_facts
from plugins.common.pdl import pdl_args, pdl_for, pdl_prologue

BLOCK_N = 64
MIN_ROWS_PER_SPLIT = 256  # a split's share of the capacity at least this many rows
MAX_SPLITS = 64
LOG2E = 1.4426950408889634  # scores in base 2: exp2(scale * log2(e) * q.k - m), as tree_verify_mla
_OPTS = {"enable_fp_fusion": False}


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, vis_ptr, out_ptr, o_ptr, m_ptr, l_ptr,
                  s_qb, s_qt, s_qh, s_kb, s_kr, s_kg, s_vb, s_vr, s_vg, s_ob, s_ot,
                  S, REP, G, SPLITS, CAP, scale2,
                  E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
                  IEEE: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    gi = tl.program_id(0)
    sp = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    bg = b * G + gi
    vis = tl.minimum(tl.load(vis_ptr + b).to(tl.int32), CAP)  # never past the cache
    tiles = tl.cdiv(vis, BLOCK_N)
    per = tl.cdiv(tiles, SPLITS)  # tiles per split
    t_lo = sp * per
    t_hi = tl.minimum(t_lo + per, tiles)
    mi = tl.arange(0, BLOCK_M)
    r = mi // S
    t = mi % S
    live = mi < REP * S
    ei = tl.arange(0, E)
    head = gi * REP + r  # [BLOCK_M] query head
    q = tl.load(q_ptr + b * s_qb + t[:, None] * s_qt + head[:, None] * s_qh + ei[None, :], mask=live[:, None],
                other=0.0)  # [BLOCK_M, E]
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, E), tl.float32)
    kv_base = b * s_kb + gi * s_kg
    vv_base = b * s_vb + gi * s_vg
    for tile in range(t_lo, t_hi):
        rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = rows < vis
        k = tl.load(k_ptr + kv_base + rows[:, None].to(tl.int64) * s_kr + ei[None, :], mask=ok[:, None],
                    other=0.0)  # [BLOCK_N, E]
        if IEEE:
            sc = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            sc = tl.dot(q, tl.trans(k))
        sc = tl.where(ok[None, :], sc * scale2, float("-inf"))  # [BLOCK_M, BLOCK_N] fp32, base-2 logits
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + vv_base + rows[:, None].to(tl.int64) * s_vr + ei[None, :], mask=ok[:, None],
                    other=0.0)  # [BLOCK_N, E]
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if DIRECT:
        dst = out_ptr + b * s_ob + t[:, None] * s_ot + head[:, None] * E + ei[None, :]
        tl.store(dst, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=live[:, None])
    else:
        part = (bg * SPLITS + sp).to(tl.int64) * BLOCK_M + mi  # [BLOCK_M] partial row
        tl.store(o_ptr + part[:, None] * E + ei[None, :], acc, mask=live[:, None])
        tl.store(m_ptr + part, m_i, mask=live)
        tl.store(l_ptr + part, l_i, mask=live)


@triton.jit
def _combine_kernel(o_ptr, m_ptr, l_ptr, out_ptr, s_ob, s_ot, S, REP, G, SPLITS,
                    E: tl.constexpr, BLOCK_M: tl.constexpr, S_PAD: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    mi = tl.program_id(0)
    gi = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    bg = b * G + gi
    sp = tl.arange(0, S_PAD)
    ok = sp < SPLITS
    part = (bg * SPLITS + sp).to(tl.int64) * BLOCK_M + mi  # [S_PAD]
    m = tl.load(m_ptr + part, mask=ok, other=float("-inf"))
    l_s = tl.load(l_ptr + part, mask=ok, other=0.0)
    big = tl.max(m, axis=0)  # finite: split 0 holds row 0 (visible >= 1)
    w = tl.where(m > float("-inf"), tl.exp2(m - big), 0.0)  # [S_PAD] (m in base 2)
    ei = tl.arange(0, E)
    o = tl.load(o_ptr + part[:, None] * E + ei[None, :], mask=ok[:, None], other=0.0)  # [S_PAD, E]
    y = tl.sum(o * w[:, None], axis=0) / tl.sum(l_s * w, axis=0)
    r = mi // S
    t = mi % S
    dst = out_ptr + b * s_ob + t * s_ot + (gi * REP + r) * E + ei
    tl.store(dst, y.to(out_ptr.dtype.element_ty))


def block_m(rep: int, s: int) -> int:
    return max(16, triton.next_power_of_2(rep * s))


def num_splits(b: int, g: int, cap: int, device: torch.device) -> int:
    """Splits of the key range: ~2 programs per SM over the b * g heads, each split >= MIN_ROWS_PER_SPLIT rows of
    the capacity (the visible length is only known on the device)."""
    want = triton.cdiv(2 * device_facts(device).sms, max(1, b * g))
    return max(1, min(want, cap // MIN_ROWS_PER_SPLIT, MAX_SPLITS))


def drafter_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, visible: torch.Tensor,
                             scale: float, out: torch.Tensor, splits: int | None = None) -> None:
    """q [b, s, h, e], k_cache / v_cache [b, cap, g, e] (unit stride along e), visible [b] int -> out [b, s, h*e]
    (contiguous).  splits overrides num_splits (tests)."""
    b, s, h, e = q.shape
    cap, g = k_cache.shape[1], k_cache.shape[2]
    rep = h // g
    if b * g == 0:
        return
    sp = splits or num_splits(b, g, cap, q.device)
    bm = block_m(rep, s)
    direct = sp == 1
    if direct:
        o_part = m_part = l_part = out
    else:
        ws = torch.empty(b * g * sp * bm * (e + 2), dtype=torch.float32, device=q.device)
        n = b * g * sp * bm
        o_part, m_part, l_part = ws[:n * e], ws[n * e:n * (e + 1)], ws[n * (e + 1):]
    ieee = q.dtype == torch.float32
    opts = {**_OPTS, **pdl_args(pdl_for(q))}
    _split_kernel[(g, sp, b)](q, k_cache, v_cache, visible, out, o_part, m_part, l_part,
                               q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1),
                               k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                               out.stride(0), out.stride(1), s, rep, g, sp, cap, float(scale) * LOG2E,
                               E=e, BLOCK_M=bm, BLOCK_N=BLOCK_N, DIRECT=direct, IEEE=ieee,
                               num_warps=4 if bm * e <= 64 * 64 else 8, num_stages=2, **opts)
    if direct:
        return
    _combine_kernel[(rep * s, g, b)](o_part, m_part, l_part, out, out.stride(0), out.stride(1), s, rep, g, sp,
                                      E=e, BLOCK_M=bm, S_PAD=triton.next_power_of_2(sp), num_warps=1, **opts)
