"""Small building blocks shared by the target and drafter forward passes (the fused kernels of
plugins/layer_fusion on CUDA, their torch references elsewhere; GEMMs are cuBLAS's, or plugins/skinny_gemm's for
few tokens with KDTREE_SKINNY_GEMM=1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from core.env_flags import env_flag
from plugins.common.precision import acc
from plugins.layer_fusion import rms_norm, silu_mul
from plugins.skinny_gemm import skinny_gemm
from plugins.skinny_gemm.launch import supports as skinny_supports

__all__ = ["linear", "rms_norm", "swiglu_mlp"]

# KDTREE_SKINNY_GEMM=1: few-token bf16 GEMMs on CUDA go to plugins/skinny_gemm instead of cuBLAS (off until
# benchmarks/skinny_gemm.py and the rank benchmark measure it on the GPU)
SKINNY_GEMM = env_flag("KDTREE_SKINNY_GEMM", False)
_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype") and \
    torch._C._dispatch_has_kernel_for_dispatch_key("aten::mm.dtype", "CUDA")


def linear(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., k] . w [n, k]^T (+ c [..., n]) accumulated in fp32 (fp64 for fp64) and rounded once to
    out_dtype (default x's).  On CUDA a bf16 / fp16 product with an fp32 result is cuBLAS's fp32-output
    GEMM (aten::mm.dtype: the router's scores and the logits straight from the accumulator, no cast
    kernel); c is addmm's beta = 1 (the shared expert's down projection accumulates into the routed
    output: one GEMM instead of a GEMM and an add), in place: c is consumed (a contiguous c is the
    result's storage), because an out-of-place addmm first copies c into a new output (one more kernel).
    Elsewhere both sides are upcast.  With SKINNY_GEMM, a CUDA bf16 product of at most 32 rows is
    kdtree::skinny_gemm's (same sum in fp32, rounded once; c added in its epilogue)."""
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
    if not skinny_supports(x2, w, c2, out_f32):
        return None
    return skinny_gemm(x2, w, c2, out_f32).view(*x.shape[:-1], n)


def swiglu_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, c: torch.Tensor | None = None
               ) -> torch.Tensor:
    """x [..., d], gate_up [2i, d] (gate rows | up rows), down [d, i] -> [..., d] (+ c, accumulated into c by
    the down projection's GEMM: c is consumed)."""
    return linear(silu_mul(linear(x, gate_up)), down, c=c)
