"""Triton grouped expert GEMMs for moe_w4a16: gate/up (split-K partials), SiLU * up of the summed partials,
down (routing weight), combine.

Both GEMMs run "swapped": a program computes out^T [BN weight rows, BM tokens] = W [BN, k] . X^T [k, BM],
so the weight rows fill the tensor core's M side and the few tokens of an expert its N side (>= 16,
padding masked).  Grid (expert slot, BN block of output rows, [split x] token tile): expert slot
a < n_active reads the local expert id active[a] and its token count from the routing workspace; slots
past n_active and experts with no tokens do nothing.  The grid's first dim is min(e_local, t * K), a
static bound.  A program takes token tiles z, z + MT, ... of its expert and, for each, streams its k range.
Small token counts give few (expert, row block) pairs, so gate/up splits k over programs and writes fp32
partials [splits, t*K, 2i]; silu_mul_kernel sums them once in a fixed order (deterministic, no atomics, no
memset) into h [t*K, i], which down reads like gate/up reads x.

INT4 (build_pipeline/moe_layout.py): a [BN, 32] int32 tile of a 256-block holds 8 nibble planes;
plane p is the K-contiguous [BN, 32] slice k = 256 b + 32 p + (0..31) of one scale group.  The plane is
dequantised in registers (`_plane`: shift, mask, or with 0x4B000000, one fp32 subtraction, times the
group scale, one rounding to x's dtype, as the reference's dequantise-then-cast) and fed to the dot;
the dots of a k block chain on one accumulator.  The token operand is loaded [BM, 32] (k contiguous,
16-byte vectors, so Triton pipelines it with cp.async like the weights) and transposed in shared memory.
Scales: per plane [BN] loads, or (SCALE_TILE) one [BN, 8] tile per k block (any scale strides).
Dense (bf16 / fp32 checkpoints): the same loop reads the weights directly, no scales.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, acc, DOT_PREC: tl.constexpr):
    """acc + a @ b in fp32; DOT_PREC "interp" (TRITON_INTERPRET runs, whose bf16 dot is wrong) multiplies
    fp32 copies, "ieee" fp32 operands exactly, "tf32" the operands as they are (bf16 on the GPU)."""
    if DOT_PREC == "interp":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=DOT_PREC)


@triton.jit
def _plane(w, P: tl.constexpr, scale, dtype: tl.constexpr):
    """Nibble plane P of int32 words w [BN, 32], dequantised: q * scale [BN] -> [BN, 32] in dtype.

    (v | 0x4B000000) read as fp32 is 2^23 + v exactly (v = q + 8 in [0, 15]), so one subtraction gives q;
    the product is rounded once to dtype, as the reference's dequantise-then-cast does."""
    q = (((w >> (4 * P)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # [BN, 32] q exactly
    return (q * scale[:, None]).to(dtype)


@triton.jit
def _plane_scale(s_e, s8, rn, nmask, g, stride_sn, stride_sg, P: tl.constexpr, SCALE_TILE: tl.constexpr):
    """The [BN] scales of group g (= 8 kb + P) of rows rn: picked from the kb's [BN, 8] tile s8 when
    SCALE_TILE, else loaded on their own."""
    if SCALE_TILE:
        return tl.sum(tl.where(tl.arange(0, 8)[None, :] == P, s8, 0.0), axis=1)
    else:
        return tl.load(s_e + rn * stride_sn + g * stride_sg, mask=nmask, other=0.0).to(tl.float32)


@triton.jit
def _owned_expert(pid_e, counts_ptr, active_ptr, e_local):
    """(expert, its slot count) for grid row pid_e: the pid_e-th active expert, or (0, 0) past
    n_active = counts[e_local] (active[a] is unset there), so the program does nothing."""
    live = pid_e < tl.load(counts_ptr + e_local)
    e = tl.where(live, tl.load(active_ptr + pid_e), 0)
    cnt = tl.where(live, tl.load(counts_ptr + e), 0)
    return e, cnt


@triton.jit
def _token_tile(lists_ptr, e, T, m0, cnt, BM: tl.constexpr):
    """Slots [m0, m0 + BM) of expert e's list: (slot ids [BM], valid [BM])."""
    rm = m0 + tl.arange(0, BM)
    mmask = rm < cnt
    return tl.load(lists_ptr + e * T + rm, mask=mmask, other=0), mmask


@triton.jit
def gate_up_kernel(x_ptr, w_ptr, s_ptr, part_ptr, counts_ptr, active_ptr, lists_ptr,
                   T, D, N2, e_local, n_slots, stride_we, stride_wn, stride_se, stride_sn, stride_sg,
                   TOPK: tl.constexpr, INT4: tl.constexpr, N_KB: tl.constexpr, KB_PER: tl.constexpr,
                   MT: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, SCALE_TILE: tl.constexpr,
                   DOT_PREC: tl.constexpr):
    """part[split, s, n] = sum over this split's k of w13_e[n, k] x[s // K, k], for the slots s of expert e.

    x [t, d]; w13 int32 [e, 2i, kp/8] (INT4) or [e, 2i, d] (dense); scales [e, kp/32, 2i] (any strides);
    part [splits, t*K, 2i] fp32 (gate rows then up rows; silu_mul_kernel sums the splits).
    Grid (active expert slot, BN-row block of the 2i rows, split * MT + token tile): split-K over blocks of
    256 k (KB_PER per split) gives small token counts enough programs; token tiles past MT loop.
    """
    pid_e = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_z = tl.program_id(2)
    split = pid_z // MT
    e, cnt = _owned_expert(pid_e, counts_ptr, active_ptr, e_local)
    rn = pid_n * BN + tl.arange(0, BN)  # [BN] rows of w13 (gate rows < i <= up rows)
    nmask = rn < N2
    rj = tl.arange(0, 32)
    w_e = w_ptr + e.to(tl.int64) * stride_we
    s_e = s_ptr + e.to(tl.int64) * stride_se
    part = part_ptr + split.to(tl.int64) * n_slots * N2
    m0 = (pid_z % MT) * BM
    while m0 < cnt:  # (a while, not range(cnt): the interpreter cannot range over a loaded value)
        slot, mmask = _token_tile(lists_ptr, e, T, m0, cnt, BM)  # [BM]
        x_rows = x_ptr + (slot // TOPK).to(tl.int64) * D  # [BM]
        acc = tl.zeros([BN, BM], tl.float32)
        for kk in range(0, KB_PER):  # constexpr trip count: the interpreter cannot range over a runtime int
            kb = split * KB_PER + kk
            kb_ok = kb < N_KB
            if INT4:
                w = tl.load(w_e + rn[:, None] * stride_wn + kb * 32 + rj[None, :], mask=nmask[:, None] & kb_ok,
                            other=0)  # [BN, 32] int32: 8 nibble planes of 32 k each
                s8 = w  # placeholder when the scales are loaded per plane
                if SCALE_TILE:
                    s8 = tl.load(s_e + rn[:, None] * stride_sn + (kb * 8 + tl.arange(0, 8))[None, :] * stride_sg,
                                 mask=nmask[:, None] & kb_ok, other=0.0).to(tl.float32)  # [BN, 8] group scales
            for p in tl.static_range(8):
                rk = kb * 256 + p * 32 + rj  # [32]
                kmask = (rk < D) & kb_ok
                xk = tl.load(x_rows[:, None] + rk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)  # [BM, 32]
                if INT4:
                    sc = _plane_scale(s_e, s8, rn, nmask & kb_ok, kb * 8 + p, stride_sn, stride_sg, p, SCALE_TILE)
                    a = _plane(w, p, sc, xk.dtype)  # [BN, 32]
                else:
                    a = tl.load(w_e + rn[:, None] * stride_wn + rk[None, :], mask=nmask[:, None] & kmask[None, :],
                                other=0.0)  # [BN, 32]
                acc = _dot(a, tl.trans(xk), acc, DOT_PREC)
        tl.store(part + slot[None, :].to(tl.int64) * N2 + rn[:, None], acc, mask=nmask[:, None] & mmask[None, :])
        m0 += MT * BM


@triton.jit
def silu_mul_kernel(part_ptr, h_ptr, idx_ptr, I, n_slots, e_start, e_local, SPLITS: tl.constexpr,
                    BI: tl.constexpr):
    """h[s, j] = silu(gate) * up for the slots s routed to a local expert, gate / up the sums over the SPLITS
    partials part[:, s, j] / part[:, s, I + j] (fixed order: deterministic), rounded once to h's dtype.

    part [SPLITS, t*K, 2i] fp32 -> h [t*K, i].  Grid (slot, BI block of i).  The partials are read once here
    instead of by every row block of down_kernel."""
    s = tl.program_id(0).to(tl.int64)
    rj = tl.program_id(1) * BI + tl.arange(0, BI)  # [BI]
    le = tl.load(idx_ptr + s) - e_start
    m = (rj < I) & (le >= 0) & (le < e_local)
    g = tl.zeros([BI], tl.float32)
    u = tl.zeros([BI], tl.float32)
    for sp in tl.static_range(SPLITS):
        row = part_ptr + (sp * n_slots + s) * (2 * I)
        g += tl.load(row + rj, mask=m, other=0.0)
        u += tl.load(row + I + rj, mask=m, other=0.0)
    tl.store(h_ptr + s * I + rj, (g / (1.0 + tl.exp(-g)) * u).to(h_ptr.dtype.element_ty), mask=m)


@triton.jit
def down_kernel(h_ptr, w_ptr, s_ptr, topw_ptr, out_ptr, counts_ptr, active_ptr, lists_ptr,
                T, D, I, e_local, stride_we, stride_wn, stride_se, stride_sn, stride_sg,
                INT4: tl.constexpr, N_KB: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                SCALE_TILE: tl.constexpr, DOT_PREC: tl.constexpr):
    """out[s, n] = topk_w[s] * (down_e[n] . h[s]), h = silu(gate) * up from silu_mul_kernel.

    h [t*K, i] (x's dtype); w2 int32 [e, d, kp/8] (INT4) or [e, d, i] (dense); scales [e, kp/32, d];
    out [t*K, d] (x's dtype).  Grid (active expert slot, BN block of d, token tile).
    """
    pid_e = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, cnt = _owned_expert(pid_e, counts_ptr, active_ptr, e_local)
    rn = pid_n * BN + tl.arange(0, BN)  # [BN] output features
    nmask = rn < D
    rj = tl.arange(0, 32)
    w_e = w_ptr + e.to(tl.int64) * stride_we
    s_e = s_ptr + e.to(tl.int64) * stride_se
    m0 = tl.program_id(2) * BM
    while m0 < cnt:  # (a while, not range(cnt): the interpreter cannot range over a loaded value)
        slot, mmask = _token_tile(lists_ptr, e, T, m0, cnt, BM)  # [BM]
        h_rows = h_ptr + slot.to(tl.int64) * I  # [BM]
        acc = tl.zeros([BN, BM], tl.float32)
        for kb in range(0, N_KB):  # N_KB constexpr: the interpreter cannot range over a runtime int
            if INT4:
                w = tl.load(w_e + rn[:, None] * stride_wn + kb * 32 + rj[None, :], mask=nmask[:, None], other=0)
                s8 = w  # placeholder when the scales are loaded per plane
                if SCALE_TILE:
                    s8 = tl.load(s_e + rn[:, None] * stride_sn + (kb * 8 + tl.arange(0, 8))[None, :] * stride_sg,
                                 mask=nmask[:, None], other=0.0).to(tl.float32)  # [BN, 8]
            for p in tl.static_range(8):
                rk = kb * 256 + p * 32 + rj
                kmask = rk < I
                hk = tl.load(h_rows[:, None] + rk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)  # [BM, 32]
                if INT4:
                    sc = _plane_scale(s_e, s8, rn, nmask, kb * 8 + p, stride_sn, stride_sg, p, SCALE_TILE)
                    a = _plane(w, p, sc, hk.dtype)  # [BN, 32]
                else:
                    a = tl.load(w_e + rn[:, None] * stride_wn + rk[None, :], mask=nmask[:, None] & kmask[None, :],
                                other=0.0)
                acc = _dot(a, tl.trans(hk), acc, DOT_PREC)
        tw = tl.load(topw_ptr + slot, mask=mmask, other=0.0)  # [BM] fp32 routing weights
        out = acc * tw[None, :]
        tl.store(out_ptr + slot[None, :].to(tl.int64) * D + rn[:, None], out.to(out_ptr.dtype.element_ty),
                 mask=nmask[:, None] & mmask[None, :])
        m0 += tl.num_programs(2) * BM


@triton.jit
def combine_kernel(out_ptr, idx_ptr, y_ptr, D, e_start, e_local, K: tl.constexpr, BD: tl.constexpr):
    """y[t] = sum over the token's K slots routed to local experts of out[t*K + j] (fp32 sum, slot order)."""
    t = tl.program_id(0).to(tl.int64)
    rd = tl.program_id(1) * BD + tl.arange(0, BD)
    dmask = rd < D
    acc = tl.zeros([BD], tl.float32)
    for j in tl.static_range(K):
        le = tl.load(idx_ptr + t * K + j) - e_start
        ok = (le >= 0) & (le < e_local)
        v = tl.load(out_ptr + (t * K + j) * D + rd, mask=dmask & ok, other=0.0)
        acc += v.to(tl.float32)
    tl.store(y_ptr + t * D + rd, acc.to(y_ptr.dtype.element_ty), mask=dmask)
