"""Triton kernels of a decoder layer's elementwise stages (reference.py holds their semantics).

Why: a layer's glue (norms, residual adds, rope, the latent row's assembly, SiLU * up) was ~50 small
torch kernels per layer per round, each a launch (~1.5-3 us of GPU time at decode sizes) around a few
KB of data.  Each kernel here is one launch per stage and reads its inputs once:
  add_rms_norm  s = x + (delta [+ delta2]); y = rms_norm(s) * w        (one program per row)
  mla_rope_q    q_full[t, h] = [q_lat[t, h] | rope(q_pe[t, h])]         (one program per (token, head))
  mla_rope_kv   out[t] = [rms_norm(c_kv[t]) * w | rope(k_pe[t])]        (one program per token)
  silu_mul      h[t, j] = silu(gate[t, j]) * up[t, j]                   (programs over (t, i) tiles)
  head_norm_rope  out[t, h] = rope(rms_norm(x[t, h]) * w)              (the drafter's q / k heads; per (t, h))
Rounding: every value the reference rounds to the storage dtype is rounded here at the same point
(`.to(dtype)` then back to fp32); fp contraction is off, so fp32 models also match the reference's
products; exp and division are the IEEE ones torch uses (rsqrt, as torch's, is
the hardware approximation).  Only the RMS reduction's summation order
differs.  Strides are passed (views of q_b's output, of the bmm's [h, t, c] output, of the cache's
scratch are read and written in place).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

_OPTS = {"enable_fp_fusion": False}


def _warps(width: int) -> int:
    return max(1, min(16, triton.next_power_of_2(width) // 256))


@triton.jit
def _add_rms_norm_kernel(x_ptr, a_ptr, b_ptr, s_ptr, w_ptr, y_ptr, D, s_x, s_a, s_b, s_s, s_y, eps,
                         HAS_ADD: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < D
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
                               num_warps=_warps(d), **_OPTS)


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
    lo = (x1 * cos).to(dt).to(tl.float32) - (x2 * sin).to(dt).to(tl.float32)
    hi = (x2 * cos).to(dt).to(tl.float32) + (x1 * sin).to(dt).to(tl.float32)
    tl.store(dst_ptr + j, lo.to(dt), mask=m)
    tl.store(dst_ptr + R2 + j, hi.to(dt), mask=m)


@triton.jit
def _mla_rope_q_kernel(q_ptr, lat_ptr, cos_ptr, sin_ptr, out_ptr, P, C, R2, s_qt, s_qh, s_lt, s_lh, s_ct,
                       s_ot, s_oh, INTERLEAVE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    m = offs < C
    out = out_ptr + t * s_ot + h * s_oh
    tl.store(out + offs, tl.load(lat_ptr + t * s_lt + h * s_lh + offs, mask=m, other=0.0), mask=m)
    _rotate_store(q_ptr + t * s_qt + h * s_qh + P, cos_ptr + t * s_ct, sin_ptr + t * s_ct, out + C, R2,
                  INTERLEAVE, BLOCK_R)


def mla_rope_q_triton(q: torch.Tensor, q_lat: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool,
                      out: torch.Tensor) -> None:
    """q [t, h, p+r], q_lat [t, h, c], cos/sin [t, r/2] (unit stride along the last dim) -> out [t, h, c+r]."""
    t, h, c = q_lat.shape
    r2 = cos.shape[-1]
    if t == 0:
        return
    _mla_rope_q_kernel[(t, h)](q, q_lat, cos, sin, out, q.shape[-1] - 2 * r2, c, r2, q.stride(0), q.stride(1),
                               q_lat.stride(0), q_lat.stride(1), cos.stride(0), out.stride(0), out.stride(1),
                               INTERLEAVE=interleave, BLOCK_C=triton.next_power_of_2(c),
                               BLOCK_R=triton.next_power_of_2(r2), num_warps=_warps(c), **_OPTS)


@triton.jit
def _norm_row(src, w_ptr, dst, D, eps, BLOCK: tl.constexpr):
    """dst[:D] = rms_norm(src[:D]) * w, rounded where transformers' RMSNorm rounds (as _add_rms_norm_kernel)."""
    offs = tl.arange(0, BLOCK)
    m = offs < D
    x = tl.load(src + offs, mask=m, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / D
    xn = (x * tl.math.rsqrt(var + eps)).to(dst.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(dst + offs, (w * xn).to(dst.dtype.element_ty), mask=m)


@triton.jit
def _mla_rope_kv_kernel(lat_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, ql_ptr, qw_ptr, qo_ptr, N, C, R2, Q,
                        s_lt, s_ct, s_ob, s_on, s_qt, s_qo, eps, INTERLEAVE: tl.constexpr,
                        BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr):
    """Program (t, 0): token t's latent row; program (t, 1) (a grid of two columns): its query's low-rank row."""
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
        BLOCK_Q=triton.next_power_of_2(q) if has_q else 2, num_warps=_warps(max(c, q)), **_OPTS)


@triton.jit
def _head_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, E2, s_xt, s_xh, s_ct, s_ot, s_oh, eps,
                           INTERLEAVE: tl.constexpr, BLOCK: tl.constexpr):
    """Program (t, h): out[t, h] = rope(rms_norm(x[t, h]) * w), the row held in registers as its two rope
    halves (pairs (2j, 2j+1) when INTERLEAVE, else (j, j + E2)); rounded where the reference rounds."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    j = tl.arange(0, BLOCK)
    m = j < E2
    if INTERLEAVE:
        i1, i2 = 2 * j, 2 * j + 1
    else:
        i1, i2 = j, E2 + j
    src = x_ptr + t * s_xt + h * s_xh
    x1 = tl.load(src + i1, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + i2, mask=m, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    r = tl.math.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * E2) + eps)
    w1 = tl.load(w_ptr + i1, mask=m, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + i2, mask=m, other=0.0).to(tl.float32)
    y1 = (w1 * (x1 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    y2 = (w2 * (x2 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    cos = tl.load(cos_ptr + t * s_ct + j, mask=m, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * s_ct + j, mask=m, other=0.0).to(tl.float32)
    lo = (y1 * cos).to(dt).to(tl.float32) - (y2 * sin).to(dt).to(tl.float32)
    hi = (y2 * cos).to(dt).to(tl.float32) + (y1 * sin).to(dt).to(tl.float32)
    out = out_ptr + t * s_ot + h * s_oh
    tl.store(out + j, lo.to(dt), mask=m)
    tl.store(out + E2 + j, hi.to(dt), mask=m)


def head_norm_rope_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                          interleave: bool, out: torch.Tensor) -> None:
    """x [t, h, e] (unit stride along e), cos/sin [t, e/2] -> out [t, h, e] = rope(rms_norm(x) * weight)."""
    t, h, e = x.shape
    if t * h == 0:
        return
    e2 = e // 2
    _head_norm_rope_kernel[(t, h)](x, weight, cos, sin, out, e2, x.stride(0), x.stride(1), cos.stride(0),
                                   out.stride(0), out.stride(1), eps, INTERLEAVE=interleave,
                                   BLOCK=triton.next_power_of_2(e2), num_warps=1, **_OPTS)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, I, s_g, s_o, BLOCK: tl.constexpr, IEEE_EXP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = j < I
    dt = out_ptr.dtype.element_ty
    # a wider gate_up (fp32 GEMM output) is rounded to out's dtype first, as the reference does
    g = tl.load(gu_ptr + t * s_g + j, mask=m, other=0.0).to(dt).to(tl.float32)
    u = tl.load(gu_ptr + t * s_g + I + j, mask=m, other=0.0).to(dt).to(tl.float32)
    if IEEE_EXP:  # torch's expf (libdevice); the interpreter has no libdevice
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    act = tl.math.div_rn(g, 1.0 + e).to(dt).to(tl.float32)
    tl.store(out_ptr + t * s_o + j, (act * u).to(dt), mask=m)


def silu_mul_triton(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    """gate_up [t, 2i] (unit stride along the last dim; out's dtype or wider) -> out [t, i]."""
    t, i = out.shape
    if t == 0:
        return
    block = min(1024, triton.next_power_of_2(i))
    _silu_mul_kernel[(t, triton.cdiv(i, block))](gate_up, out, i, gate_up.stride(0), out.stride(0), BLOCK=block,
                                                 IEEE_EXP=gate_up.is_cuda, num_warps=_warps(block), **_OPTS)
