"""Small building blocks shared by the target and drafter forward passes (the fused kernels of
plugins/layer_fusion on CUDA, their torch references elsewhere; GEMMs are cuBLAS's)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plugins.common.precision import acc
from plugins.layer_fusion import rms_norm, silu_mul

__all__ = ["linear", "rms_norm", "swiglu_mlp"]

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
    Elsewhere both sides are upcast."""
    out_dtype = out_dtype or x.dtype
    n, k = w.shape
    if x.dtype == w.dtype == out_dtype and (c is None or c.dtype == x.dtype):
        if c is None:
            return F.linear(x, w)
        return c.reshape(-1, n).addmm_(x.reshape(-1, k), w.t()).view(*x.shape[:-1], n)  # [..., n]
    if _MM_OUT_DTYPE and c is None and x.is_cuda and x.dtype == w.dtype and out_dtype == torch.float32 \
            and x.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(x.reshape(-1, k), w.t(), out_dtype=torch.float32).view(*x.shape[:-1], n)
    y = F.linear(acc(x), acc(w))  # [..., n]
    return (y if c is None else y + acc(c)).to(out_dtype)


def swiglu_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, c: torch.Tensor | None = None
               ) -> torch.Tensor:
    """x [..., d], gate_up [2i, d] (gate rows | up rows), down [d, i] -> [..., d] (+ c, accumulated into c by
    the down projection's GEMM: c is consumed)."""
    return linear(silu_mul(F.linear(x, gate_up)), down, c=c)
