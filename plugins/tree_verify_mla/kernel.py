"""Triton kernels for tree_verify_mla: split-KV absorbed MLA with a tree bitmask, and the combine step.

Shape vocabulary as in reference.py: b requests, n tree nodes, h heads, m = n * h query rows per
request (row = node * h + head), l_max cache capacity, d_v value width (512), d_r rope width (64),
d_qk = d_v + d_r, s splits of the key range.

All heads share one latent row per key (MQA), so one program treats BLOCK_M (node, head) rows of
one request as the M side of a GEMM against BLOCK_N latent rows: scores = q[:, :d_v] k[:, :d_v]^T +
q[:, d_v:] k[:, d_v:]^T, values = k[:, :d_v].  Softmax runs in base 2 (log2 e folded into the scale).

Key range of request r: the valid length L = min(cache_lens[r], l_max) (read on the device) padded
to whole key tiles, followed by the n tree rows: tile t < T_c = cdiv(L, BLOCK_N) reads cache rows,
tile t >= T_c reads tree rows (t - T_c) * BLOCK_N + [0, BLOCK_N) under the ancestor mask.  Both
kinds run through one software-pipelined loop, and the s splits share all T_c + cdiv(n, BLOCK_N)
tiles equally, so the tree adds no second pipeline ramp and no long pole on one split.

Program (pid0, s, r): pid0 = m-block * DV_SPLIT + value slice.  With DV_SPLIT = 2 a program owns
d_v / 2 output columns: it computes the full scores (q_own k_own^T + q_other k_other^T + q_r k_r^T)
and the value product on its half only, so its accumulator is [BLOCK_M, d_v / 2] (one warpgroup of
wgmma holds 64 x 256 fp32) at the price of computing the scores twice (1.53x the flops).

PREFETCH (constexpr, sm_90): before its PDL wait a program puts the first committed cache tiles of its range in
flight into L2, so their HBM latency overlaps the predecessor kernel instead of following it.

With one split the program writes out/lse directly; otherwise a partial (o normalised, lse base 2)
per split that the combine kernel merges by weight 2^(lse_s - max).  A split with no visible key
writes only lse = -inf; the combine never reads its o.  PDL (constexpr, GPU only): programmatic
dependent launch; the split kernel waits for its predecessor before reading anything and lets the
combine launch at once, the combine waits for the split kernel before reading the partials.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

LOG2E = 1.4426950408889634  # the launcher folds it into the scale
PF_CHUNK = tl.constexpr(65536)  # bytes per L2 bulk prefetch request (PREFETCH)
PF_TILES = tl.constexpr(2)  # cache tiles a program prefetches: its pipeline's ramp, not its whole range (L2 holds
# every program's first two tiles at once: 264 programs x 2 x 36 KB = 19 MB at 32K)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b; fp32 inputs take exact fp32 products (IEEE), not tf32."""
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _attend_tile(acc, m_i, l_i, q_own, q_oth, q_r, k_own, k_oth, k_r, visible, scale2,
                 TWO: tl.constexpr, IEEE: tl.constexpr):
    """One online-softmax step over a key tile; rows with no visible key so far keep m = -inf safely.
    k_own is this program's value slice (and part of the score width), k_oth the rest (TWO only)."""
    qk = _dot(q_own, tl.trans(k_own), tl.zeros([q_own.shape[0], k_own.shape[0]], tl.float32), IEEE)
    if TWO:
        qk = _dot(q_oth, tl.trans(k_oth), qk, IEEE)
    qk = _dot(q_r, tl.trans(k_r), qk, IEEE) * scale2  # [BLOCK_M, BLOCK_N] base-2 scores
    qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))  # [BLOCK_M]
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # exp2(-inf - 0) = 0, never -inf - -inf
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(qk - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = _dot(p.to(k_own.dtype), k_own, acc * alpha[:, None], IEEE)  # [BLOCK_M, BLOCK_DV]
    return acc, m_new, l_i


@triton.jit
def _attend_tile_keys_m(acc_t, m_i, l_i, q_own, q_oth, q_r, k_own, k_oth, k_r, visible_t, scale2,
                        TWO: tl.constexpr, IEEE: tl.constexpr):
    """_attend_tile with keys as the M side of both products (KEYS_M): scores^T = k q^T [BLOCK_N,
    BLOCK_M] and o^T += v^T p^T [BLOCK_DV, BLOCK_M], so a few query rows still fill wgmma's M = 64
    with keys and q is read once per tile as the small N operand."""
    qk = _dot(k_own, tl.trans(q_own), tl.zeros([k_own.shape[0], q_own.shape[0]], tl.float32), IEEE)
    if TWO:
        qk = _dot(k_oth, tl.trans(q_oth), qk, IEEE)
    qk = _dot(k_r, tl.trans(q_r), qk, IEEE) * scale2  # [BLOCK_N, BLOCK_M] base-2 scores
    qk = tl.where(visible_t, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 0))  # [BLOCK_M]
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(qk - m_use[None, :])
    l_i = l_i * alpha + tl.sum(p, 0)
    acc_t = _dot(tl.trans(k_own), p.to(k_own.dtype), acc_t * alpha[None, :], IEEE)  # [BLOCK_DV, BLOCK_M]
    return acc_t, m_new, l_i


@triton.jit
def _prefetch_cache_head(cache_ptr, lens_ptr, stride_cb, stride_cl, n, l_max, num_splits,
                         BLOCK_N: tl.constexpr):
    """An L2 hint (sm_90's bulk prefetch, not waited for) of the first PF_TILES committed cache tiles of this
    program's key range, issued before the PDL wait: the cache and its lengths are written only by kv_commit at the
    end of a round, never by the kernels the wait is for.  The launcher asks for it only where the cache rows and
    their base are 16-byte aligned; the rows' span is then a multiple of 16 bytes."""
    s = tl.program_id(1)
    r = tl.program_id(2).to(tl.int64)
    length = tl.minimum(tl.maximum(tl.load(lens_ptr + r), 0), l_max)
    t_cache = tl.cdiv(length, BLOCK_N)
    per_split = tl.cdiv(t_cache + tl.cdiv(n, BLOCK_N), num_splits)
    row_lo = s * per_split * BLOCK_N
    row_hi = tl.minimum(tl.minimum(row_lo + PF_TILES * BLOCK_N, (s + 1) * per_split * BLOCK_N), length)
    row_bytes = stride_cl * (cache_ptr.dtype.element_ty.primitive_bitwidth // 8)
    nbytes = tl.maximum(row_hi - row_lo, 0).to(tl.int64) * row_bytes
    base = cache_ptr.to(tl.pointer_type(tl.int8)) + r * stride_cb * (cache_ptr.dtype.element_ty.primitive_bitwidth
                                                                       // 8) + row_lo.to(tl.int64) * row_bytes
    off = tl.arange(0, 4).to(tl.int64) * PF_CHUNK  # [4] requests: PF_TILES x 64 rows x 1152 B fits 3
    size = tl.minimum(nbytes - off, PF_CHUNK).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r", [base + off, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit(do_not_specialize=["stride_lb", "stride_ln", "n", "h", "l_max", "num_splits"])  # one binary per config
def tree_verify_mla_split_kernel(
        q_ptr, cache_ptr, lens_ptr, tree_ptr, mask_ptr, out_ptr, lse_ptr, opart_ptr, lpart_ptr,
        stride_qb, stride_qn, stride_qh,
        stride_cb, stride_cl,
        stride_tb, stride_tn,
        stride_mb, stride_mn,
        stride_ob, stride_on, stride_oh,
        stride_lb, stride_ln,
        n, h, l_max, num_splits, scale2,
        D_V: tl.constexpr, D_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        DV_SPLIT: tl.constexpr, KEYS_M: tl.constexpr, DIRECT: tl.constexpr, IEEE: tl.constexpr,
        PDL: tl.constexpr, PREFETCH: tl.constexpr = False):
    BLOCK_DV: tl.constexpr = D_V // DV_SPLIT
    TWO: tl.constexpr = DV_SPLIT == 2
    if PREFETCH:  # before the wait: the committed cache does not depend on the predecessor grid
        _prefetch_cache_head(cache_ptr, lens_ptr, stride_cb, stride_cl, n, l_max, num_splits, BLOCK_N)
    if PDL:
        gdc_wait()  # the previous kernel (q, cache, workspace readers) has finished
        gdc_launch_dependents()  # the combine may become resident now; it waits for our completion
    pid0 = tl.program_id(0)
    mb = pid0 // DV_SPLIT
    dv0 = (pid0 % DV_SPLIT) * BLOCK_DV  # first value column of this program
    dv_oth = BLOCK_DV - dv0  # the other half (TWO only)
    s = tl.program_id(1)
    r = tl.program_id(2).to(tl.int64)
    m_rows = n * h

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query rows (node * h + head)
    row_ok = offs_m < m_rows
    node = offs_m // h
    head = offs_m % h
    offs_v = tl.arange(0, BLOCK_DV)
    offs_r = tl.arange(0, D_R)
    offs_n = tl.arange(0, BLOCK_N)

    q_rows = q_ptr + r * stride_qb + node * stride_qn + head * stride_qh  # [BLOCK_M] pointers
    q_own = tl.load(q_rows[:, None] + dv0 + offs_v[None, :], mask=row_ok[:, None], other=0.0)  # [BLOCK_M, BLOCK_DV]
    q_oth = q_own
    if TWO:
        q_oth = tl.load(q_rows[:, None] + dv_oth + offs_v[None, :], mask=row_ok[:, None], other=0.0)
    q_r = tl.load(q_rows[:, None] + D_V + offs_r[None, :], mask=row_ok[:, None], other=0.0)  # [BLOCK_M, D_R]

    if KEYS_M:
        acc = tl.zeros([BLOCK_DV, BLOCK_M], dtype=tl.float32)  # o^T
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    # key tiles of this request: T_c cache tiles, then the tree tiles; split s takes an equal share
    length = tl.minimum(tl.maximum(tl.load(lens_ptr + r), 0), l_max)
    t_cache = tl.cdiv(length, BLOCK_N)
    t_all = t_cache + tl.cdiv(n, BLOCK_N)
    per_split = tl.cdiv(t_all, num_splits)
    t_lo = s * per_split
    t_hi = tl.minimum(t_lo + per_split, t_all)
    cache_base = cache_ptr + r * stride_cb
    tree_base = tree_ptr + r * stride_tb
    mask_rows = mask_ptr + r * stride_mb + node * stride_mn  # [BLOCK_M] pointers to word 0
    for t in range(t_lo, t_hi):
        in_cache = t < t_cache
        start = tl.where(in_cache, t, t - t_cache) * BLOCK_N  # first row in the cache / in the tree
        rows = start + offs_n  # [BLOCK_N]
        key_ok = rows < tl.where(in_cache, length, n)
        base = tl.where(in_cache, cache_base, tree_base)
        stride = tl.where(in_cache, stride_cl, stride_tn)
        k_rows = base + rows.to(tl.int64) * stride  # [BLOCK_N] pointers
        k_own = tl.load(k_rows[:, None] + dv0 + offs_v[None, :], mask=key_ok[:, None], other=0.0)  # [BLOCK_N, BLOCK_DV]
        k_oth = k_own
        if TWO:
            k_oth = tl.load(k_rows[:, None] + dv_oth + offs_v[None, :], mask=key_ok[:, None], other=0.0)
        k_r = tl.load(k_rows[:, None] + D_V + offs_r[None, :], mask=key_ok[:, None], other=0.0)  # [BLOCK_N, D_R]
        # tree tiles: bit j of node i is bit j % 64 of word j // 64 (BLOCK_N divides 64: one word per tile)
        word = tl.load(mask_rows + start // 64, mask=row_ok & (t >= t_cache), other=0)  # [BLOCK_M] int64
        bit = (start % 64) + offs_n  # [BLOCK_N] in [0, 64)
        if KEYS_M:
            half = tl.where(bit[:, None] < 32, word.to(tl.int32)[None, :], (word >> 32).to(tl.int32)[None, :])
            in_tree = ((half >> (bit % 32)[:, None]) & 1) != 0  # [BLOCK_N, BLOCK_M], int32 math
            visible = (in_tree | in_cache) & key_ok[:, None]
            acc, m_i, l_i = _attend_tile_keys_m(acc, m_i, l_i, q_own, q_oth, q_r, k_own, k_oth, k_r, visible,
                                                scale2, TWO, IEEE)
        else:
            half = tl.where(bit[None, :] < 32, word.to(tl.int32)[:, None], (word >> 32).to(tl.int32)[:, None])
            in_tree = ((half >> (bit % 32)[None, :]) & 1) != 0  # [BLOCK_M, BLOCK_N], int32 math
            visible = (in_tree | in_cache) & key_ok[None, :]
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q_own, q_oth, q_r, k_own, k_oth, k_r, visible, scale2,
                                         TWO, IEEE)

    seen = l_i > 0.0
    if KEYS_M:
        o = tl.trans(acc / tl.where(seen, l_i, 1.0)[None, :])  # [BLOCK_M, BLOCK_DV]
    else:
        o = acc / tl.where(seen, l_i, 1.0)[:, None]  # [BLOCK_M, BLOCK_DV]
    lse2 = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))  # [BLOCK_M] base 2
    lse_ok = row_ok & (dv0 == 0)  # every value slice has the same lse: slice 0 writes it
    if DIRECT:  # one split: no workspace, no combine
        o_rows = out_ptr + r * stride_ob + node * stride_on + head * stride_oh + dv0
        tl.store(o_rows[:, None] + offs_v[None, :], o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        tl.store(lse_ptr + r * stride_lb + node * stride_ln + head, lse2 * 0.6931471805599453, mask=lse_ok)
    else:
        part = (r * num_splits + s) * m_rows + offs_m  # [BLOCK_M] int64 row index into the workspace
        tl.store(lpart_ptr + part, lse2, mask=lse_ok)
        tl.store(opart_ptr + part[:, None] * D_V + dv0 + offs_v[None, :], o, mask=(row_ok & seen)[:, None])


@triton.jit(do_not_specialize=["stride_lb", "stride_ln", "n", "h", "num_splits"])
def tree_verify_mla_combine_kernel(
        opart_ptr, lpart_ptr, out_ptr, lse_ptr,
        stride_ob, stride_on, stride_oh,
        stride_lb, stride_ln,
        n, h, num_splits,
        S_PAD: tl.constexpr, D_V: tl.constexpr, BLOCK_DV: tl.constexpr, PDL: tl.constexpr):
    """Program (row, dv block, r): out = sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max)."""
    if PDL:
        gdc_wait()  # the split kernel has finished and its partials are visible
    m = tl.program_id(0)
    dvb = tl.program_id(1)
    r = tl.program_id(2).to(tl.int64)
    m_rows = n * h
    node = m // h
    head = m % h

    offs_s = tl.arange(0, S_PAD)
    part = (r * num_splits + offs_s) * m_rows + m  # [S_PAD]
    lse2 = tl.load(lpart_ptr + part, mask=offs_s < num_splits, other=float("-inf"))  # [S_PAD]
    mx = tl.max(lse2, 0)
    mx_use = tl.where(mx == float("-inf"), 0.0, mx)
    wgt = tl.exp2(lse2 - mx_use)  # [S_PAD], 0 for empty splits
    tot = tl.sum(wgt, 0)
    live = lse2 > float("-inf")

    offs_d = dvb * BLOCK_DV + tl.arange(0, BLOCK_DV)
    o = tl.load(opart_ptr + part[:, None] * D_V + offs_d[None, :], mask=live[:, None], other=0.0)  # [S_PAD, BLOCK_DV]
    res = tl.sum(o * wgt[:, None], 0) / tl.where(tot > 0.0, tot, 1.0)  # [BLOCK_DV]
    tl.store(out_ptr + r * stride_ob + node * stride_on + head * stride_oh + offs_d,
             res.to(out_ptr.dtype.element_ty))
    lse_val = tl.where(tot > 0.0, (mx + tl.log2(tl.where(tot > 0.0, tot, 1.0))) * 0.6931471805599453,
                       float("-inf"))
    tl.store(lse_ptr + r * stride_lb + node * stride_ln + head, lse_val, mask=dvb == 0)
