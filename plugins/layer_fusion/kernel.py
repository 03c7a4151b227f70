"""Triton kernels of a decoder layer's elementwise stages (reference.py holds their semantics).

Why: a layer's glue (norms, residual adds, rope, the latent row's assembly, SiLU * up) was ~50 small
torch kernels per layer per round, each a launch (~1.5-3 us of GPU time at decode sizes) around a few
KB of data.  Each kernel here is one launch per stage and reads its inputs once:
  add_rms_norm  s = x + (delta [+ delta2]); y = rms_norm(s) * w        (one program per row)
  rope_cos_sin  cos[t], sin[t] = cos / sin(position[t] * inv_freq) * scale  (the step's rope tables, one launch)
  mla_q_absorb  q_full[t, h] = [q_nope[t, h] . W_UK[h] | rope(q_pe[t, h])]  (programs over (token block, head,
                64 latent columns); the product in fp32, rounded once, as the bmm it replaces)
  mla_v_absorb  o[t, h] = o_lat[t, h] . W_UV[h]^T                     (programs over (token block, head, 16
                value dims) at decode sizes; fp32 accumulation rounded once, as the bmm it replaces)
  mla_rope_kv   out[t] = [rms_norm(c_kv[t]) * w | rope(k_pe[t])]        (one program per token)
  silu_mul      h[t, j] = silu(gate[t, j]) * up[t, j]                   (programs over (t, i) tiles)
  kv_norm_rope_store  the drafter's k heads normed and roped (rope(rms_norm(k[t, g]) * w)), its v heads as they
                are, into the cache rows of their positions, for one layer or all (per (t, g, layer and k or v));
                the block's q heads normed and roped too
  drafter_block  the drafter block's positions, tokens, visible length; the committed length advanced (per request)
  embed_range   a rank's share of a vocab-parallel embedding: its rows, zeros outside its range (per token)
Rounding: every value the reference rounds to the storage dtype is rounded here at the same point
(`.to(dtype)` then back to fp32); fp contraction is off, so fp32 models also match the reference's
products; exp and division are the IEEE ones torch uses (rsqrt, as torch's, is
the hardware approximation).  Only the RMS reduction's summation order
differs.  Strides are passed (views of q_b's output and of the cache's
scratch are read and written in place).  The two absorb kernels hold a GEMM: a per-head
[t, p] x [p, c] or [t, c] x [c, u] product is too small for cuBLAS to be more than a launch (~5-6 us at t = 1
on the H200); their summation order is the tensor core's, not the bmm's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from core.env_flags import env_flag
from plugins.common.activation_kernel import silu_mul_rounded
from plugins.common.pdl import pdl_args, pdl_for, pdl_prologue

_OPTS = {"enable_fp_fusion": False}
# The absorb kernels load their W_UK / W_UV tile, add_rms_norm its weight row, before the PDL wait (weights: nothing in
# the round writes them), so that latency overlaps the predecessor's tail, as skinny_gemm's EARLY_WEIGHTS do (AR step
# -5 % there).  Why: in the captured K2.6 AR step (benchmarks/results/k26-rank.json, H200, 2026-12-06) q_absorb adds
# 5.5 and v_absorb 6.1 µs a layer past their predecessors for 1 MB of weights each, the norms 3-5 µs.  Measured
# (k26-switches-h100.json, H100, 40 layers): AR step -1.9 %, DDTree-16 round -0.4 %; with the MoE's 16-warp gate_up
# beside it -3.6 / -0.4 %: on by default (KDTREE_GLUE_EARLY=0 turns it off; k26_switches glue_early).  The same
# results: v_absorb then takes the whole latent width in one dot (its 512, where it stepped through 128 at a time),
# the others load what they loaded before.
EARLY_WEIGHTS = env_flag("KDTREE_GLUE_EARLY", True)
EARLY_MAX_K = 512  # v_absorb's whole-width dot up to this latent width (its weight tile in registers: 16 KB)
# v_absorb's narrow u blocks (16 value dims: 8 heads x 8 programs, the whole width in one dot, W_UV before the wait)
# up to this many tokens; past it 64-wide blocks (16 programs at 8 heads) that step through the width 128 at a time.
# V_ABSORB_TREE (KDTREE_V_ABSORB_TREE, k26_switches absorb_tree): up to 32, a DDTree round's 17 tokens included.  On:
# the K2.6 rank (H100, 40 layers, 4K, k26-switches-h100.json call 13) DDTree-16 round 5915.5 -> 5855.8 µs (-1.0 %), the
# AR step level (3361.0 / 3361.8)
V_ABSORB_TREE = env_flag("KDTREE_V_ABSORB_TREE", True)


def _opts(t: torch.Tensor) -> dict:
    """A launch's options: no fp contraction, and PDL (constexpr and launch attribute) for t's device."""
    return {**_OPTS, **pdl_args(pdl_for(t))}


def _warps(width: int) -> int:
    return max(1, min(16, triton.next_power_of_2(width) // 256))


@triton.jit
def _add_rms_norm_kernel(x_ptr, a_ptr, b_ptr, s_ptr, w_ptr, y_ptr, D, s_x, s_a, s_b, s_s, s_y, eps,
                         HAS_ADD: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr, EARLY: tl.constexpr,
                         PDL: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < D
    if EARLY:  # the norm's weight before the PDL wait (EARLY_WEIGHTS)
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    x = tl.load(x_ptr + row * s_x + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_ADD:
        a = tl.load(a_ptr + row * s_a + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_B:
            b = tl.load(b_ptr + row * s_b + offs, mask=m, other=0.0).to(tl.float32)
            a = (a + b).to(s_ptr.dtype.element_ty).to(tl.float32)
        s = (x + a).to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + row * s_s + offs, s, mask=m)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / D
    xn = (x * tl.math.rsqrt(var + eps)).to(y_ptr.dtype.element_ty).to(tl.float32)
    if not EARLY:
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * s_y + offs, (w * xn).to(y_ptr.dtype.element_ty), mask=m)


def add_rms_norm_triton(x: torch.Tensor, delta: torch.Tensor | None, delta2: torch.Tensor | None,
                        weight: torch.Tensor, eps: float, s: torch.Tensor | None, y: torch.Tensor) -> None:
    """x, delta, delta2, s, y [t, d] (unit stride along d); s = x + (delta + delta2), y = rms_norm(s) * weight.
    delta None: y = rms_norm(x) * weight (s unused)."""
    t, d = x.shape
    if t == 0:
        return
    has_add, has_b = delta is not None, delta2 is not None
    a = delta if has_add else x
    b = delta2 if has_b else a
    s = s if has_add else y
    _add_rms_norm_kernel[(t,)](x, a, b, s, weight, y, d, x.stride(0), a.stride(0), b.stride(0), s.stride(0),
                               y.stride(0), eps, HAS_ADD=has_add, HAS_B=has_b, BLOCK=triton.next_power_of_2(d),
                               EARLY=EARLY_WEIGHTS, num_warps=_warps(d), **_opts(x))


@triton.jit
def _rotate(x1, x2, cos, sin, dt: tl.constexpr):
    """(x1 * cos - x2 * sin, x2 * cos + x1 * sin) in fp32 (any shapes, fp32 values), each product and sum rounded
    to dt as torch does: the rope of every kernel here."""
    lo = (x1 * cos).to(dt).to(tl.float32) - (x2 * sin).to(dt).to(tl.float32)
    hi = (x2 * cos).to(dt).to(tl.float32) + (x1 * sin).to(dt).to(tl.float32)
    return lo, hi


@triton.jit
def _rotate_store(src_ptr, cos_ptr, sin_ptr, dst_ptr, R2, INTERLEAVE: tl.constexpr, BLOCK_R: tl.constexpr):
    """dst[:R2] = x1 * cos - x2 * sin, dst[R2:] = x2 * cos + x1 * sin, each product and sum rounded to
    dst's dtype as torch does (src: the r rope values of one row, pairs interleaved or as halves)."""
    j = tl.arange(0, BLOCK_R)
    m = j < R2
    if INTERLEAVE:
        x1 = tl.load(src_ptr + 2 * j, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src_ptr + 2 * j + 1, mask=m, other=0.0).to(tl.float32)
    else:
        x1 = tl.load(src_ptr + j, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src_ptr + R2 + j, mask=m, other=0.0).to(tl.float32)
    dt = dst_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + j, mask=m, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + j, mask=m, other=0.0).to(tl.float32)
    lo, hi = _rotate(x1, x2, cos, sin, dt)
    tl.store(dst_ptr + j, lo.to(dt), mask=m)
    tl.store(dst_ptr + R2 + j, hi.to(dt), mask=m)


@triton.jit
def _rope_cos_sin_kernel(pos_ptr, inv_ptr, cos_ptr, sin_ptr, T, R2, scale, IEEE: tl.constexpr, BT: tl.constexpr,
                         BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    """Program (BT positions): cos / sin of position x inv_freq (fp32) times scale, rounded once.  IEEE (on the
    GPU): libdevice's cos / sin, the CUDA math library's that torch calls (tl.cos is the approximate one);
    the interpreter has only NumPy's."""
    pdl_prologue(PDL)
    rt = tl.program_id(0) * BT + tl.arange(0, BT)  # [BT]
    j = tl.arange(0, BLOCK_R)
    tm = rt < T
    jm = j < R2
    pos = tl.load(pos_ptr + rt, mask=tm, other=0).to(tl.float32)  # [BT]
    angle = pos[:, None] * tl.load(inv_ptr + j, mask=jm, other=0.0)[None, :]  # [BT, BLOCK_R] fp32
    dt = cos_ptr.dtype.element_ty
    at = rt.to(tl.int64)[:, None] * R2 + j[None, :]
    m = tm[:, None] & jm[None, :]
    c, s = _scaled_cos_sin(angle, scale, IEEE)
    tl.store(cos_ptr + at, c.to(dt), mask=m)
    tl.store(sin_ptr + at, s.to(dt), mask=m)


@triton.jit
def _scaled_cos_sin(angle, scale, IEEE: tl.constexpr):
    """cos and sin of fp32 angles times scale; IEEE: libdevice's (the CUDA math library's, as torch), else Triton's
    (the interpreter's NumPy)."""
    if IEEE:
        c, s = libdevice.cos(angle), libdevice.sin(angle)
    else:
        c, s = tl.cos(angle), tl.sin(angle)
    return c * scale, s * scale


def rope_cos_sin_triton(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, cos: torch.Tensor,
                        sin: torch.Tensor) -> None:
    """positions [t] (contiguous integers), inv_freq [r/2] fp32 -> cos, sin [t, r/2] (contiguous)."""
    t, r2 = cos.shape
    if t == 0:
        return
    bt = min(64, triton.next_power_of_2(t))
    _rope_cos_sin_kernel[(triton.cdiv(t, bt),)](positions, inv_freq, cos, sin, t, r2, float(scale),
                                                IEEE=positions.is_cuda, BT=bt, BLOCK_R=triton.next_power_of_2(r2),
                                                num_warps=1, **_opts(positions))


@triton.jit
def _mla_q_absorb_kernel(q_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, T, P, C, R2, s_qt, s_qh, s_wh, s_wp, s_ct, s_ot,
                         s_oh, INTERLEAVE: tl.constexpr, IEEE: tl.constexpr, N_CB: tl.constexpr, BT: tl.constexpr,
                         BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, EARLY: tl.constexpr,
                         PDL: tl.constexpr):
    """Program (token block, head, c block): out[rows, h, c block] = q_nope[rows, h] . W_UK[h][:, c block],
    fp32 accumulation rounded once; the program past the last c block ropes the rows' q_pe instead.  EARLY: the
    W_UK tile loaded before the PDL wait (EARLY_WEIGHTS)."""
    h = tl.program_id(1).to(tl.int64)
    cb = tl.program_id(2)
    rp = tl.arange(0, BLOCK_P)
    rc = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    pm = rp < P
    w_tile = w_ptr + h * s_wh + rp[:, None] * s_wp + rc[None, :]  # [BLOCK_P, BLOCK_C] pointers
    w_mask = pm[:, None] & (rc < C)[None, :]
    if EARLY:  # the rope program (cb == N_CB) loads nothing: its columns are all past C
        w = tl.load(w_tile, mask=w_mask, other=0.0)  # [BLOCK_P, BLOCK_C]
    pdl_prologue(PDL)
    rt = tl.program_id(0) * BT + tl.arange(0, BT)  # [BT] tokens
    tm = rt < T
    dt = out_ptr.dtype.element_ty
    q_rows = q_ptr + rt.to(tl.int64) * s_qt + h * s_qh  # [BT] pointers
    o_rows = out_ptr + rt.to(tl.int64) * s_ot + h * s_oh  # [BT] pointers
    if cb == N_CB:  # rope(q_pe) into out[..., C:], as _rotate_store, one row per token
        j = tl.arange(0, BLOCK_R)
        m = tm[:, None] & (j < R2)[None, :]  # [BT, BLOCK_R]
        src = q_rows[:, None] + P
        if INTERLEAVE:
            x1 = tl.load(src + 2 * j[None, :], mask=m, other=0.0).to(tl.float32)
            x2 = tl.load(src + 2 * j[None, :] + 1, mask=m, other=0.0).to(tl.float32)
        else:
            x1 = tl.load(src + j[None, :], mask=m, other=0.0).to(tl.float32)
            x2 = tl.load(src + R2 + j[None, :], mask=m, other=0.0).to(tl.float32)
        cs = rt.to(tl.int64)[:, None] * s_ct + j[None, :]
        cos = tl.load(cos_ptr + cs, mask=m, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + cs, mask=m, other=0.0).to(tl.float32)
        lo, hi = _rotate(x1, x2, cos, sin, dt)
        tl.store(o_rows[:, None] + C + j[None, :], lo.to(dt), mask=m)
        tl.store(o_rows[:, None] + C + R2 + j[None, :], hi.to(dt), mask=m)
    else:
        qn = tl.load(q_rows[:, None] + rp[None, :], mask=tm[:, None] & pm[None, :], other=0.0)  # [BT, BLOCK_P]
        if not EARLY:
            w = tl.load(w_tile, mask=w_mask, other=0.0)  # [BLOCK_P, BLOCK_C]
        if IEEE:
            acc = tl.dot(qn, w, input_precision="ieee")
        else:
            acc = tl.dot(qn, w)  # [BT, BLOCK_C] fp32
        tl.store(o_rows[:, None] + rc[None, :], acc.to(dt), mask=tm[:, None] & (rc < C)[None, :])


def mla_q_absorb_triton(q: torch.Tensor, w_uk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool,
                        out: torch.Tensor) -> None:
    """q [t, h, p+r], w_uk [h, p, c], cos/sin [t, r/2] (unit stride along each last dim) -> out [t, h, c+r]."""
    t, h, _ = q.shape
    p, c = w_uk.shape[1], w_uk.shape[2]
    r2 = cos.shape[-1]
    if t == 0:
        return
    bt = min(64, max(16, triton.next_power_of_2(t)))
    block_c = min(64, max(16, triton.next_power_of_2(c)))  # 8 heads x 8 blocks of the 512 latent columns
    n_cb = triton.cdiv(c, block_c)
    _mla_q_absorb_kernel[(triton.cdiv(t, bt), h, n_cb + 1)](
        q, w_uk, cos, sin, out, t, p, c, r2, q.stride(0), q.stride(1), w_uk.stride(0), w_uk.stride(1),
        cos.stride(0), out.stride(0), out.stride(1), INTERLEAVE=interleave, IEEE=q.dtype == torch.float32,
        N_CB=n_cb, BT=bt, BLOCK_P=max(16, triton.next_power_of_2(p)), BLOCK_C=block_c,
        BLOCK_R=triton.next_power_of_2(r2), EARLY=EARLY_WEIGHTS, num_warps=4, **_opts(q))


@triton.jit
def _mla_v_absorb_kernel(o_ptr, w_ptr, out_ptr, T, U, s_ot, s_oh, s_wh, s_wu, s_yt, s_yh, C: tl.constexpr,
                         IEEE: tl.constexpr, BT: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_K: tl.constexpr,
                         EARLY: tl.constexpr, PDL: tl.constexpr):
    """Program (token block, head, u block): out[rows, h, u block] = o_lat[rows, h] . W_UV[h][u block]^T, the
    latent width C (a compile-time constant: the loop's trip count) in BLOCK_K slices, fp32 accumulation rounded
    once.  EARLY (BLOCK_K >= C): the one W_UV tile loaded before the PDL wait (EARLY_WEIGHTS)."""
    h = tl.program_id(1).to(tl.int64)
    ru = tl.program_id(2) * BLOCK_U + tl.arange(0, BLOCK_U)  # [BLOCK_U] value dims
    um = ru < U
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + h * s_wh + ru.to(tl.int64) * s_wu  # [BLOCK_U] pointers
    if EARLY:
        # [BLOCK_K, BLOCK_U]: the whole width
        w_all = tl.load(w_rows[None, :] + rk[:, None], mask=(rk < C)[:, None] & um[None, :], other=0.0)
    pdl_prologue(PDL)
    rt = tl.program_id(0) * BT + tl.arange(0, BT)  # [BT] tokens
    tm = rt < T
    o_rows = o_ptr + rt.to(tl.int64) * s_ot + h * s_oh  # [BT] pointers
    acc = tl.zeros([BT, BLOCK_U], dtype=tl.float32)
    for k0 in range(0, C, BLOCK_K):
        km = (k0 + rk) < C
        o = tl.load(o_rows[:, None] + k0 + rk[None, :], mask=tm[:, None] & km[None, :], other=0.0)  # [BT, BLOCK_K]
        if EARLY:
            w = w_all
        else:
            # [BLOCK_K, BLOCK_U]
            w = tl.load(w_rows[None, :] + k0 + rk[:, None], mask=km[:, None] & um[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(o, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(o, w, acc)
    y = out_ptr + rt.to(tl.int64)[:, None] * s_yt + h * s_yh + ru[None, :]
    tl.store(y, acc.to(out_ptr.dtype.element_ty), mask=tm[:, None] & um[None, :])


def mla_v_absorb_triton(o_lat: torch.Tensor, w_uv: torch.Tensor, out: torch.Tensor) -> None:
    """o_lat [t, h, c], w_uv [h, u, c] (unit stride along c) -> out [t, h, u] (unit stride along u)."""
    t, h, c = o_lat.shape
    u = w_uv.shape[1]
    if t == 0:
        return
    bt = min(64, max(16, triton.next_power_of_2(t)))
    narrow = t <= (32 if V_ABSORB_TREE else 16)  # decode: 8 heads x 8 blocks of 16
    block_u = max(16, min(16 if narrow else 64, triton.next_power_of_2(u)))
    width = max(16, triton.next_power_of_2(c))
    early = EARLY_WEIGHTS and block_u == 16 and width <= EARLY_MAX_K  # the whole width's W_UV tile, 16 KB at most
    _mla_v_absorb_kernel[(triton.cdiv(t, bt), h, triton.cdiv(u, block_u))](
        o_lat, w_uv, out, t, u, o_lat.stride(0), o_lat.stride(1), w_uv.stride(0), w_uv.stride(1), out.stride(0),
        out.stride(1), C=c, IEEE=o_lat.dtype == torch.float32, BT=bt, BLOCK_U=block_u,
        BLOCK_K=width if early else min(128, width), EARLY=early, num_warps=4, **_opts(o_lat))


@triton.jit
def _norm_row(src, w_ptr, dst, D, eps, BLOCK: tl.constexpr):
    """dst[:D] = rms_norm(src[:D]) * w, rounded where transformers' RMSNorm rounds (as _add_rms_norm_kernel)."""
    offs = tl.arange(0, BLOCK)
    m = offs < D
    x = tl.load(src + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(dst + offs, _normed(x, w_ptr, offs, m, D, eps, dst.dtype.element_ty), mask=m)


@triton.jit
def _normed(x, w_ptr, offs, m, D, eps, dt: tl.constexpr):
    """rms_norm(x) * w of one row held in registers (x fp32 [BLOCK], 0 in masked lanes) in dt, rounded where
    transformers' RMSNorm rounds."""
    xn = (x * tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)).to(dt).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    return (w * xn).to(dt)


@triton.jit
def _mla_rope_kv_kernel(lat_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, ql_ptr, qw_ptr, qo_ptr, N, C, R2, Q,
                        s_lt, s_ct, s_ob, s_on, s_qt, s_qo, eps, INTERLEAVE: tl.constexpr,
                        BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr, PDL: tl.constexpr):
    """Program (t, 0): token t's latent row; program (t, 1) (a grid of two columns): its query's low-rank row."""
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) == 1:
        _norm_row(ql_ptr + t * s_qt, qw_ptr, qo_ptr + t * s_qo, Q, eps, BLOCK_Q)
    else:
        out = out_ptr + (t // N) * s_ob + (t % N) * s_on
        src = lat_ptr + t * s_lt
        _norm_row(src, w_ptr, out, C, eps, BLOCK_C)
        _rotate_store(src + C, cos_ptr + t * s_ct, sin_ptr + t * s_ct, out + C, R2, INTERLEAVE, BLOCK_R)


def mla_rope_kv_triton(latent: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                       interleave: bool, out: torch.Tensor, q_low: torch.Tensor | None = None,
                       q_weight: torch.Tensor | None = None, q_out: torch.Tensor | None = None) -> None:
    """latent [t, c+r], cos/sin [t, r/2] -> out [b, n, c+r] (t = b * n; unit stride along the last dim); with
    q_low [t, q]: also q_out [t, q] = rms_norm(q_low) * q_weight, in the same launch (a second program per token)."""
    b, n, _ = out.shape
    c, r2 = weight.shape[0], cos.shape[-1]
    if b * n == 0:
        return
    has_q = q_low is not None
    ql, qw, qo = (q_low, q_weight, q_out) if has_q else (latent, weight, latent)  # unused without q_low
    q = ql.shape[-1] if has_q else 1
    _mla_rope_kv_kernel[(b * n, 2 if has_q else 1)](
        latent, weight, cos, sin, out, ql, qw, qo, n, c, r2, q, latent.stride(0), cos.stride(0),
        out.stride(0), out.stride(1), ql.stride(0), qo.stride(0), eps, INTERLEAVE=interleave,
        BLOCK_C=triton.next_power_of_2(c), BLOCK_R=triton.next_power_of_2(r2),
        BLOCK_Q=triton.next_power_of_2(q) if has_q else 2, num_warps=_warps(max(c, q)), **_opts(latent))


@triton.jit
def _norm_rope_head(src, w_ptr, cos_row, sin_row, E2, eps, dt: tl.constexpr, INTERLEAVE: tl.constexpr,
                    BLOCK: tl.constexpr):
    """rope(rms_norm(x) * w) of the head row at src, as its two rope halves (pairs (2j, 2j+1) when INTERLEAVE,
    else (j, j + E2)), rounded where the reference rounds: (lo, hi) [BLOCK] fp32, the de-interleaved output."""
    j = tl.arange(0, BLOCK)
    m = j < E2
    if INTERLEAVE:
        i1, i2 = 2 * j, 2 * j + 1
    else:
        i1, i2 = j, E2 + j
    x1 = tl.load(src + i1, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + i2, mask=m, other=0.0).to(tl.float32)
    r = tl.math.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * E2) + eps)
    w1 = tl.load(w_ptr + i1, mask=m, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + i2, mask=m, other=0.0).to(tl.float32)
    y1 = (w1 * (x1 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    y2 = (w2 * (x2 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    cos = tl.load(cos_row + j, mask=m, other=0.0).to(tl.float32)
    sin = tl.load(sin_row + j, mask=m, other=0.0).to(tl.float32)
    return _rotate(y1, y2, cos, sin, dt)


@triton.jit
def _kv_norm_rope_store_kernel(kv_ptr, w_ptr, cos_ptr, sin_ptr, pos_ptr, k_ptr, v_ptr, q_ptr, qw_ptr, qo_ptr,
                               E2, N, CAP, G, H, L, s_kvt, s_kvl, s_kvw, s_kvg, s_wl, s_ct, s_cl, s_cb, s_cr, s_cg,
                               s_qt, s_qh, s_qot, s_qoh, eps, INTERLEAVE: tl.constexpr, HAS_Q: tl.constexpr,
                               BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (t, head, 2 * layer + w): token t = request * N + row of the [t, L, 2, g, e] GEMM output goes to
    cache row min(pos[t], CAP - 1) of its request in that layer; w = 0: k_cache[.., head] = rope(rms_norm(k[t,
    head]) * w), w = 1: v_cache[.., head] = v[t, head] as is (heads >= G idle).  HAS_Q: programs (t, head, 2L)
    also write q_out[t, head] = rope(rms_norm(q[t, head]) * q_w) for head < H."""
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    lw = tl.program_id(2)
    j = tl.arange(0, BLOCK)
    m = j < E2
    if lw < 2 * L:
        if g < G:
            layer = (lw // 2).to(tl.int64)
            row = tl.minimum(tl.load(pos_ptr + t), CAP - 1)
            dst = layer * s_cl + (t // N) * s_cb + row * s_cr + g * s_cg
            src = kv_ptr + t * s_kvt + layer * s_kvl + g * s_kvg
            if lw % 2 == 0:
                dt = k_ptr.dtype.element_ty
                lo, hi = _norm_rope_head(src, w_ptr + layer * s_wl, cos_ptr + t * s_ct, sin_ptr + t * s_ct, E2, eps,
                                         dt, INTERLEAVE, BLOCK)
                tl.store(k_ptr + dst + j, lo.to(dt), mask=m)
                tl.store(k_ptr + dst + E2 + j, hi.to(dt), mask=m)
            else:
                tl.store(v_ptr + dst + j, tl.load(src + s_kvw + j, mask=m), mask=m)
                tl.store(v_ptr + dst + E2 + j, tl.load(src + s_kvw + E2 + j, mask=m), mask=m)
    elif HAS_Q:
        if g < H:
            dt = qo_ptr.dtype.element_ty
            lo, hi = _norm_rope_head(q_ptr + t * s_qt + g * s_qh, qw_ptr, cos_ptr + t * s_ct, sin_ptr + t * s_ct, E2,
                                     eps, dt, INTERLEAVE, BLOCK)
            out = qo_ptr + t * s_qot + g * s_qoh
            tl.store(out + j, lo.to(dt), mask=m)
            tl.store(out + E2 + j, hi.to(dt), mask=m)


def kv_norm_rope_store_triton(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                              sin: torch.Tensor, interleave: bool, pos: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, q: torch.Tensor | None = None,
                              q_weight: torch.Tensor | None = None, q_out: torch.Tensor | None = None) -> None:
    """kv [t, L, 2, g, e] (unit stride along e), weight [L, e], cos/sin [t, e/2], pos [b, n] int64 (t = b * n),
    k_cache / v_cache [L, b, cap, g, e] (the same strides): every layer's k heads normed and roped, v heads as they
    are, into cache rows min(pos, cap - 1); with q [t, h, e], q_weight [e]: q_out [t, h, e] = the q heads normed
    and roped (head_norm_rope) in the same launch."""
    t, layers, _, g, e = kv.shape
    h = q.shape[1] if q is not None else 0
    if t * max(g, h) == 0 or layers + h == 0:
        return
    qs = (q.stride(0), q.stride(1), q_out.stride(0), q_out.stride(1)) if q is not None else (0, 0, 0, 0)
    _kv_norm_rope_store_kernel[(t, max(g, h), 2 * layers + (q is not None))](
        kv, weight, cos, sin, pos, k_cache, v_cache, q if q is not None else kv, q_weight if q is not None else weight,
        q_out if q is not None else k_cache, e // 2, pos.shape[1], k_cache.shape[2], g, h, layers,
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), weight.stride(0), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3), *qs, eps,
        INTERLEAVE=interleave, HAS_Q=q is not None, BLOCK=triton.next_power_of_2(e // 2), num_warps=1,
        **_opts(kv))


@triton.jit
def _drafter_block_kernel(lens_ptr, ctx_len_ptr, bonus_ptr, ctx_pos_ptr, blk_pos_ptr, block_ptr, visible_ptr, A, S,
                          mask_id, BLOCK_A: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    """Program r: the drafter block's positions and tokens of request r, and its committed length advanced."""
    pdl_prologue(PDL)
    r = tl.program_id(0).to(tl.int64)
    lens = tl.load(lens_ptr + r).to(tl.int64)
    start = lens + tl.load(ctx_len_ptr + r).to(tl.int64)
    ja = tl.arange(0, BLOCK_A)
    tl.store(ctx_pos_ptr + r * A + ja, lens + ja, mask=ja < A)
    js = tl.arange(0, BLOCK_S)
    tl.store(blk_pos_ptr + r * S + js, start + js, mask=js < S)
    bonus = tl.load(bonus_ptr + r)
    tl.store(block_ptr + r * S + js, tl.where(js == 0, bonus, mask_id), mask=js < S)
    tl.store(visible_ptr + r, start + S)
    tl.store(lens_ptr + r, start.to(lens_ptr.dtype.element_ty))


def drafter_block_triton(lens: torch.Tensor, ctx_len: torch.Tensor, bonus: torch.Tensor, mask_id: int,
                         ctx_pos: torch.Tensor, blk_pos: torch.Tensor, block: torch.Tensor,
                         visible: torch.Tensor) -> None:
    """See reference.drafter_block_reference; every tensor contiguous."""
    b, a = ctx_pos.shape
    s = blk_pos.shape[1]
    if b == 0:
        return
    _drafter_block_kernel[(b,)](lens, ctx_len, bonus, ctx_pos, blk_pos, block, visible, a, s, mask_id,
                                BLOCK_A=triton.next_power_of_2(max(a, 1)), BLOCK_S=triton.next_power_of_2(s),
                                num_warps=1, **_opts(lens))


@triton.jit
def _embed_range_kernel(tok_ptr, w_ptr, out_ptr, D, start, count, s_w, s_o, BLOCK: tl.constexpr,
                        PDL: tl.constexpr):
    """Program (token, d block): the token's row of this rank's vocabulary range, or zeros outside it."""
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = j < D
    tl.store(out_ptr + t * s_o + j, _vocab_row(tok_ptr + t, w_ptr, start, count, s_w, j, m), mask=m)


@triton.jit
def _vocab_row(tok_ptr, w_ptr, start, count, s_w, j, m):
    """Columns j (mask m) of the weight row of the token at tok_ptr among this rank's ids [start, start + count),
    zeros for an id outside the range."""
    row = tl.load(tok_ptr) - start
    ok = (row >= 0) & (row < count)
    return tl.load(w_ptr + tl.where(ok, row, 0) * s_w + j, mask=m & ok, other=0.0)


def embed_range_triton(tokens: torch.Tensor, weight: torch.Tensor, start: int, count: int, out: torch.Tensor) -> None:
    """tokens [t] int64 (contiguous), weight [>= count, d] (unit last stride) -> out [t, d] (unit last stride)."""
    t, d = out.shape
    if t == 0:
        return
    block = min(1024, triton.next_power_of_2(d))
    _embed_range_kernel[(t, triton.cdiv(d, block))](tokens, weight, out, d, start, count, weight.stride(0),
                                                    out.stride(0), BLOCK=block, num_warps=_warps(block),
                                                    **_opts(tokens))


@triton.jit
def _embed_norm_rope_kernel(tok_ptr, w_ptr, nw_ptr, x_ptr, h_ptr, pos_ptr, inv_ptr, cos_ptr, sin_ptr, D, start,
                            count, R2, s_w, eps, scale, IEEE: tl.constexpr, BLOCK: tl.constexpr,
                            BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    """Program (t, 0): token t's embedding row (as _embed_range_kernel) into x and its norm into h (as _norm_row);
    program (t, 1): cos / sin of its position (as _rope_cos_sin_kernel)."""
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) == 0:
        j = tl.arange(0, BLOCK)
        m = j < D
        v = _vocab_row(tok_ptr + t, w_ptr, start, count, s_w, j, m)  # [BLOCK]
        tl.store(x_ptr + t * D + j, v, mask=m)
        tl.store(h_ptr + t * D + j, _normed(v.to(tl.float32), nw_ptr, j, m, D, eps, h_ptr.dtype.element_ty), mask=m)
    else:  # (names apart from the other branch's: Triton types a name once across both)
        jr = tl.arange(0, BLOCK_R)
        mr = jr < R2
        angle = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_ptr + jr, mask=mr, other=0.0)  # [BLOCK_R] fp32
        c, s = _scaled_cos_sin(angle, scale, IEEE)
        tl.store(cos_ptr + t * R2 + jr, c.to(cos_ptr.dtype.element_ty), mask=mr)
        tl.store(sin_ptr + t * R2 + jr, s.to(sin_ptr.dtype.element_ty), mask=mr)


def embed_norm_rope_triton(tokens: torch.Tensor, weight: torch.Tensor, start: int, count: int,
                           norm_weight: torch.Tensor, eps: float, positions: torch.Tensor, inv_freq: torch.Tensor,
                           scale: float, x: torch.Tensor, h: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor) -> None:
    """tokens, positions [t] (contiguous integers), weight [>= count, d] (unit last stride), norm_weight [d],
    inv_freq [r/2] fp32 -> x, h [t, d] and cos, sin [t, r/2] (all contiguous)."""
    t, d = x.shape
    if t == 0:
        return
    block = triton.next_power_of_2(d)
    _embed_norm_rope_kernel[(t, 2)](tokens, weight, norm_weight, x, h, positions, inv_freq, cos, sin, d, start, count,
                                    cos.shape[1], weight.stride(0), float(eps), float(scale), IEEE=tokens.is_cuda,
                                    BLOCK=block, BLOCK_R=triton.next_power_of_2(cos.shape[1]),
                                    num_warps=_warps(block), **_opts(tokens))


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, I, s_g, s_o, BLOCK: tl.constexpr, IEEE_EXP: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = j < I
    # a wider gate_up (fp32 GEMM output) is rounded to out's dtype first, as the reference does
    g = tl.load(gu_ptr + t * s_g + j, mask=m, other=0.0)
    u = tl.load(gu_ptr + t * s_g + I + j, mask=m, other=0.0)
    tl.store(out_ptr + t * s_o + j, silu_mul_rounded(g, u, out_ptr.dtype.element_ty, IEEE_EXP), mask=m)


def silu_mul_triton(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    """gate_up [t, 2i] (unit stride along the last dim; out's dtype or wider) -> out [t, i]."""
    t, i = out.shape
    if t == 0:
        return
    block = min(1024, triton.next_power_of_2(i))
    _silu_mul_kernel[(t, triton.cdiv(i, block))](gate_up, out, i, gate_up.stride(0), out.stride(0), BLOCK=block,
                                                 IEEE_EXP=gate_up.is_cuda, num_warps=_warps(block), **_opts(gate_up))
