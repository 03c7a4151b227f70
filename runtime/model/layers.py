"""Small building blocks shared by the target and drafter forward passes (the fused kernels of
plugins/layer_fusion on CUDA, their torch references elsewhere; GEMMs are cuBLAS's, or plugins/skinny_gemm's where
that wins: one token, weights up to SKINNY_MAX_WEIGHT_BYTES; KDTREE_SKINNY_GEMM=0 turns it off), and a layer's
residual step (ResidualStep), which the GEMM reading its result may take in its own launch (NORM_GEMM)."""

from __future__ import annotations

from typing import Union

import torch
import torch.nn.functional as F

from core.env_flags import env_flag
from plugins.common.precision import acc
from plugins.layer_fusion import add_rms_norm, rms_norm, silu_mul
from plugins.skinny_gemm import skinny_gemm, skinny_gemm_norm
from plugins.skinny_gemm.launch import NORM_MAX_TOKENS
from plugins.skinny_gemm.launch import supports as skinny_supports
from plugins.skinny_gemm.launch import supports_norm as skinny_supports_norm

__all__ = ["ResidualStep", "linear", "rms_norm", "swiglu_mlp"]

# KDTREE_SKINNY_GEMM (on unless "0"): bf16 GEMMs on CUDA of at most SKINNY_MAX_TOKENS tokens and weights of at most
# SKINNY_MAX_WEIGHT_BYTES go to plugins/skinny_gemm instead of cuBLAS: where it won on the H200
# (benchmarks/results/skinny-gemm.json: at t = 1 qkv_a 10.9 vs 13.3 µs, q_b 4.9 vs 6.6, o_proj 6.7 vs 6.9, router +
# shared gate_up 7.1 vs 9.0, shared down 3.2 vs 3.9; it lost at t = 16 / 17 on most shapes and at t = 1 on the dense
# MLP's 33 and 66 MB; results/k26-switches.json: the K2.6 AR step -6 %, DDTree rounds +4-10 % with every t <= 32)
SKINNY_GEMM = env_flag("KDTREE_SKINNY_GEMM", True)
SKINNY_LIMITS = (1, 31 << 20)  # (tokens, weight bytes): 32.5 MB takes qkv_a's 30.3 MB, not the dense MLP's 33.0 MB down
SKINNY_MAX_TOKENS, SKINNY_MAX_WEIGHT_BYTES = SKINNY_LIMITS  # the ones in force (a benchmark may widen them)
# KDTREE_NORM_GEMM=1 (off until the rank benchmark measures it: k26_switches norm_gemm): a ResidualStep's first GEMM,
# where skinny_gemm takes it (SKINNY_GEMM's limits: one token by default), forms s and rms_norm(s) itself
# (skinny_gemm_norm): one launch fewer per norm; in the K2.6 AR step (k26-rank.json, H200) each add_rms_norm adds
# 3-5 µs for 56 KB of bytes
NORM_GEMM = env_flag("KDTREE_NORM_GEMM", False)
# KDTREE_NORM_TREE=1 (with NORM_GEMM; off until measured: k26_switches norm_tree): the router's GEMM (fp32 out, the
# one ResidualStep consumer that returns fp32) takes its step on skinny_gemm up to launch.NORM_MAX_TOKENS tokens, a
# DDTree round's too, where the other GEMMs stay cuBLAS's (skinny-gemm-h100.json: the router + shared gate_up at
# t = 16 / 17 9.2 / 10.4 µs on the kernel, 10.6 / 10.7 on cuBLAS; qkv_a, q_b and o_proj lose there): one norm
# launch fewer per layer in a round, and the router's rows the same bits at every t
NORM_TREE = env_flag("KDTREE_NORM_TREE", False)
_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype") and \
    torch._C._dispatch_has_kernel_for_dispatch_key("aten::mm.dtype", "CUDA")


class ResidualStep:
    """A layer's residual step not taken yet: s = x + delta, x' = rms_norm(s) * weight (x, delta [..., d]; delta
    None: a norm alone, s = x).  The first linear() that reads x' may take it in its own launch (NORM_GEMM); else x'
    is add_rms_norm's (rms_norm's), launched where it is first asked for (normed(), summed(), or a linear() that does
    not take it): the kernels and their order are those of add_rms_norm right before that GEMM.  reshape() gives a
    view of the same step (its s and x' shared)."""

    def __init__(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 _out: dict | None = None):
        self.x, self.delta, self.weight, self.eps = x, delta, weight, eps
        self._out = {} if _out is None else _out  # "s", "hn": [t, d] or any shape of the same rows, once taken

    shape = property(lambda self: self.x.shape)
    dtype = property(lambda self: self.x.dtype)
    device = property(lambda self: self.x.device)
    is_cuda = property(lambda self: self.x.is_cuda)

    def reshape(self, *shape: int) -> ResidualStep:
        delta = None if self.delta is None else self.delta.reshape(*shape)
        return ResidualStep(self.x.reshape(*shape), delta, self.weight, self.eps, self._out)

    @property
    def taken(self) -> bool:
        return "s" in self._out

    def take(self, s: torch.Tensor, hn: torch.Tensor) -> None:
        """Records s and x' as a GEMM that took the step formed them."""
        self._out.update(s=s, hn=hn)

    def normed(self) -> torch.Tensor:
        """x' [..., d] (add_rms_norm's launch when no GEMM has taken the step)."""
        if not self.taken:
            if self.delta is None:
                self.take(self.x, rms_norm(self.x, self.weight, self.eps))
            else:
                self.take(*add_rms_norm(self.x, self.delta, self.weight, self.eps))
        return self._out["hn"].reshape(self.x.shape)

    def summed(self) -> torch.Tensor:
        """s [..., d]: the residual stream after the step."""
        self.normed()
        return self._out["s"].reshape(self.x.shape)


def linear(x: Union[torch.Tensor, ResidualStep], w: torch.Tensor, c: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., k] . w [n, k]^T (+ c [..., n]) accumulated in fp32 (fp64 for fp64) and rounded once to
    out_dtype (default x's).  On CUDA a bf16 / fp16 product with an fp32 result is cuBLAS's fp32-output
    GEMM (aten::mm.dtype: the router's scores and the logits straight from the accumulator, no cast
    kernel); c is addmm's beta = 1 (the shared expert's down projection accumulates into the routed
    output: one GEMM instead of a GEMM and an add), in place: c is consumed (a contiguous c is the
    result's storage), because an out-of-place addmm first copies c into a new output (one more kernel).
    Elsewhere both sides are upcast.  With SKINNY_GEMM, a CUDA bf16 product of at most SKINNY_MAX_TOKENS rows and
    SKINNY_MAX_WEIGHT_BYTES of weights is kdtree::skinny_gemm's (same sum in fp32, rounded once; c added in its
    epilogue).  x a ResidualStep: the product of its x' rows, the step taken here where skinny_gemm_norm takes it."""
    if isinstance(x, ResidualStep):
        y = None if x.taken else _skinny_norm(x, w, c, out_dtype or x.dtype)
        if y is not None:
            return y
        x = x.normed()
    out_dtype = out_dtype or x.dtype
    n, k = w.shape
    if SKINNY_GEMM and x.is_cuda:
        y = _skinny(x, w, c, out_dtype)
        if y is not None:
            return y
    if x.dtype == w.dtype == out_dtype and (c is None or c.dtype == x.dtype):
        if c is None:
            return F.linear(x, w)
        return c.reshape(-1, n).addmm_(x.reshape(-1, k), w.t()).view(*x.shape[:-1], n)  # [..., n]
    if _MM_OUT_DTYPE and c is None and x.is_cuda and x.dtype == w.dtype and out_dtype == torch.float32 \
            and x.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(x.reshape(-1, k), w.t(), out_dtype=torch.float32).view(*x.shape[:-1], n)
    y = F.linear(acc(x), acc(w))  # [..., n]
    return (y if c is None else y + acc(c)).to(out_dtype)


def _skinny(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor | None:
    """linear's product through kdtree::skinny_gemm, or None where the kernel does not take it."""
    n, k = w.shape
    out_f32 = out_dtype == torch.float32
    if out_dtype not in (x.dtype, torch.float32) or (c is not None and (out_f32 or c.dtype != x.dtype)):
        return None
    x2, c2 = x.reshape(-1, k), (None if c is None else c.reshape(-1, n))  # [t, k], [t, n]
    if x2.shape[0] > SKINNY_MAX_TOKENS or w.numel() * w.element_size() > SKINNY_MAX_WEIGHT_BYTES:
        return None
    if not skinny_supports(x2, w, c2, out_f32):
        return None
    return skinny_gemm(x2, w, c2, out_f32).view(*x.shape[:-1], n)


def _skinny_norm(step: ResidualStep, w: torch.Tensor, c: torch.Tensor | None, out_dtype: torch.dtype
                 ) -> torch.Tensor | None:
    """linear's product of a residual step's x' through kdtree::skinny_gemm_norm (the step taken there), or None
    where that does not take it (NORM_GEMM off, SKINNY_GEMM's limits (NORM_TREE's token limit for an fp32 product),
    supports_norm)."""
    if not (NORM_GEMM and SKINNY_GEMM and step.is_cuda) or c is not None or out_dtype not in (step.dtype,
                                                                                             torch.float32):
        return None
    n, k = w.shape
    rows = step.x if step.delta is None else step.delta
    delta = rows.reshape(-1, k)  # [t, k]: the kernel's x rows (a norm alone: the rows it normalises)
    res = None if step.delta is None else step.x.reshape(-1, k)  # [t, k]
    out_f32 = out_dtype == torch.float32
    tokens = NORM_MAX_TOKENS if NORM_TREE and out_f32 else SKINNY_MAX_TOKENS
    if delta.shape[0] > tokens or w.numel() * w.element_size() > SKINNY_MAX_WEIGHT_BYTES:
        return None
    if not skinny_supports_norm(delta, res, step.weight, w, out_f32):
        return None
    y, s, hn = skinny_gemm_norm(delta, res, step.weight, step.eps, w, out_f32)  # [t, n], [t, k], [t, k]
    step.take(s, hn)
    return y.view(*step.shape[:-1], n)


def swiglu_mlp(x: Union[torch.Tensor, ResidualStep], gate_up: torch.Tensor, down: torch.Tensor,
               c: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., d] (or a residual step, its x' the input), gate_up [2i, d] (gate rows | up rows), down [d, i] ->
    [..., d] (+ c, accumulated into c by the down projection's GEMM: c is consumed)."""
    return linear(silu_mul(linear(x, gate_up)), down, c=c)
