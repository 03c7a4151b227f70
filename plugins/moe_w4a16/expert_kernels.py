"""Triton grouped expert GEMMs for moe_w4a16: gate/up with SiLU*up, down with the routing weight, combine.

Both GEMMs run "swapped": a program computes out^T [BN weight rows, BM tokens] = W [BN, k] . X^T [k, BM],
so the weight rows fill the tensor core's M side and the few tokens of an expert its N side (>= 16,
padding masked).  Grid (expert slot, BN block of output rows): expert slot a < n_active reads the
local expert id active[a] and its token count from the routing workspace; slots past n_active and
experts with no tokens do nothing.  The grid's first dim is min(e_local, t * K), a static bound.
A program loops over its expert's tokens in tiles of BM and, for each, over k in blocks of 256.

INT4 (build_pipeline/moe_layout.py): a [BN, 32] int32 tile of a 256-block holds 8 nibble planes;
plane p is the K-contiguous [BN, 32] slice k = 256 b + 32 p + (0..31) of one scale group.  The
plane becomes bf16 with bit operations only: (v | 0x4300) read as bf16 is exactly 128 + v (v = q + 8,
bf16 has 8 significant bits), so dot(128 + v, x) - 136 * sum(x) = q . x, and the group scale multiplies
the [BN, BM] partial sum (fewer multiplies than scaling the [BN, 32] weights when BM <= 32).
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
def _plane_dot(w, P: tl.constexpr, xt, DOT_PREC: tl.constexpr):
    """(nibble plane P of int32 words w [BN, 32]) @ xt [32, BM] in fp32, the plane read as 128 + v.

    (v | 0x4300) is the bf16 bit pattern of 128 + v for v in [0, 15] (exact): bit operations only."""
    b = (((w >> (4 * P)) & 0xF) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True).to(xt.dtype)  # [BN, 32]
    if DOT_PREC == "interp":
        return tl.dot(b.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(b, xt, input_precision=DOT_PREC)


@triton.jit
def _owned_expert(pid_e, counts_ptr, active_ptr, e_local):
    """(expert, its slot count) for grid row pid_e: the pid_e-th active expert, or (0, 0) past
    n_active = counts[e_local] (active[a] is unset there), so the program does nothing."""
    live = pid_e < tl.load(counts_ptr + e_local)
    e = tl.where(live, tl.load(active_ptr + pid_e), 0)
    cnt = tl.where(live, tl.load(counts_ptr + e), 0)
    return e, cnt


@triton.jit
def gate_up_kernel(x_ptr, w_ptr, s_ptr, h_ptr, counts_ptr, active_ptr, lists_ptr,
                   T, D, I, e_local, stride_we, stride_wn, stride_se, stride_sg,
                   TOPK: tl.constexpr, INT4: tl.constexpr, N_KB: tl.constexpr, BN: tl.constexpr,
                   BM: tl.constexpr, DOT_PREC: tl.constexpr):
    """h[s, n] = silu(gate_e[n] . x[s // K]) * (up_e[n] . x[s // K]) for the slots s of expert e.

    x [t, d]; w13 int32 [e, 2i, kp/8] (INT4) or [e, 2i, d] (dense); scales [e, kp/32, 2i]; h [t*K, i].
    """
    pid_e = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, cnt = _owned_expert(pid_e, counts_ptr, active_ptr, e_local)
    rn = pid_n * BN + tl.arange(0, BN)  # [BN] gate rows; up rows are i + rn
    nmask = rn < I
    rj = tl.arange(0, 32)
    w_e = w_ptr + e.to(tl.int64) * stride_we
    s_e = s_ptr + e.to(tl.int64) * stride_se
    m0 = 0
    while m0 < cnt:  # (a while, not range(cnt): the interpreter cannot range over a loaded value)
        rm = m0 + tl.arange(0, BM)
        mmask = rm < cnt
        slot = tl.load(lists_ptr + e * T + rm, mask=mmask, other=0)  # [BM]
        x_rows = x_ptr + (slot // TOPK).to(tl.int64) * D  # [BM]
        acc_g = tl.zeros([BN, BM], tl.float32)
        acc_u = tl.zeros([BN, BM], tl.float32)
        for kb in range(0, N_KB):  # N_KB constexpr: the interpreter cannot range over a runtime int
            if INT4:
                wg = tl.load(w_e + rn[:, None] * stride_wn + kb * 32 + rj[None, :], mask=nmask[:, None], other=0)
                wu = tl.load(w_e + (rn + I)[:, None] * stride_wn + kb * 32 + rj[None, :], mask=nmask[:, None],
                             other=0)  # [BN, 32] int32 each
            for p in tl.static_range(8):
                rk = kb * 256 + p * 32 + rj  # [32]
                kmask = rk < D
                xt = tl.load(x_rows[None, :] + rk[:, None], mask=mmask[None, :] & kmask[:, None], other=0.0)  # [32, BM]
                if INT4:
                    sg = tl.load(s_e + (kb * 8 + p) * stride_sg + rn, mask=nmask, other=0.0).to(tl.float32)
                    su = tl.load(s_e + (kb * 8 + p) * stride_sg + I + rn, mask=nmask, other=0.0).to(tl.float32)
                    xs = 136.0 * tl.sum(xt.to(tl.float32), axis=0)  # [BM]
                    dg = _plane_dot(wg, p, xt, DOT_PREC)  # [BN, BM]
                    du = _plane_dot(wu, p, xt, DOT_PREC)
                    acc_g += sg[:, None] * (dg - xs[None, :])
                    acc_u += su[:, None] * (du - xs[None, :])
                else:
                    wmask = nmask[:, None] & kmask[None, :]
                    wgd = tl.load(w_e + rn[:, None] * stride_wn + rk[None, :], mask=wmask, other=0.0)  # [BN, 32]
                    wud = tl.load(w_e + (rn + I)[:, None] * stride_wn + rk[None, :], mask=wmask, other=0.0)
                    acc_g = _dot(wgd, xt, acc_g, DOT_PREC)
                    acc_u = _dot(wud, xt, acc_u, DOT_PREC)
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # [BN, BM] silu(gate) * up
        tl.store(h_ptr + slot[None, :].to(tl.int64) * I + rn[:, None], h.to(h_ptr.dtype.element_ty),
                 mask=nmask[:, None] & mmask[None, :])
        m0 += BM


@triton.jit
def down_kernel(h_ptr, w_ptr, s_ptr, topw_ptr, out_ptr, counts_ptr, active_ptr, lists_ptr,
                T, D, I, e_local, stride_we, stride_wn, stride_se, stride_sg,
                INT4: tl.constexpr, N_KB: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
                DOT_PREC: tl.constexpr):
    """out[s, n] = topk_w[s] * (down_e[n] . h[s]) for the slots s of expert e.

    h [t*K, i]; w2 int32 [e, d, kp/8] (INT4) or [e, d, i] (dense); scales [e, kp/32, d]; out [t*K, d].
    """
    pid_e = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, cnt = _owned_expert(pid_e, counts_ptr, active_ptr, e_local)
    rn = pid_n * BN + tl.arange(0, BN)  # [BN] output features
    nmask = rn < D
    rj = tl.arange(0, 32)
    w_e = w_ptr + e.to(tl.int64) * stride_we
    s_e = s_ptr + e.to(tl.int64) * stride_se
    m0 = 0
    while m0 < cnt:  # (a while, not range(cnt): the interpreter cannot range over a loaded value)
        rm = m0 + tl.arange(0, BM)
        mmask = rm < cnt
        slot = tl.load(lists_ptr + e * T + rm, mask=mmask, other=0)  # [BM]
        h_rows = h_ptr + slot.to(tl.int64) * I
        acc = tl.zeros([BN, BM], tl.float32)
        for kb in range(0, N_KB):  # N_KB constexpr: the interpreter cannot range over a runtime int
            if INT4:
                w = tl.load(w_e + rn[:, None] * stride_wn + kb * 32 + rj[None, :], mask=nmask[:, None], other=0)
            for p in tl.static_range(8):
                rk = kb * 256 + p * 32 + rj
                kmask = rk < I
                ht = tl.load(h_rows[None, :] + rk[:, None], mask=mmask[None, :] & kmask[:, None], other=0.0)  # [32, BM]
                if INT4:
                    s = tl.load(s_e + (kb * 8 + p) * stride_sg + rn, mask=nmask, other=0.0).to(tl.float32)
                    hs = 136.0 * tl.sum(ht.to(tl.float32), axis=0)  # [BM]
                    d = _plane_dot(w, p, ht, DOT_PREC)  # [BN, BM]
                    acc += s[:, None] * (d - hs[None, :])
                else:
                    wd = tl.load(w_e + rn[:, None] * stride_wn + rk[None, :], mask=nmask[:, None] & kmask[None, :],
                                 other=0.0)
                    acc = _dot(wd, ht, acc, DOT_PREC)
        tw = tl.load(topw_ptr + slot, mask=mmask, other=0.0)  # [BM] fp32 routing weights
        out = acc * tw[None, :]
        tl.store(out_ptr + slot[None, :].to(tl.int64) * D + rn[:, None], out.to(out_ptr.dtype.element_ty),
                 mask=nmask[:, None] & mmask[None, :])
        m0 += BM


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
