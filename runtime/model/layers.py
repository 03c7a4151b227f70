"""Small building blocks shared by the target and drafter forward passes (the fused kernels of
plugins/layer_fusion on CUDA, their torch references elsewhere; GEMMs are cuBLAS's, or plugins/skinny_gemm's where
that wins: one token (skinny_gemm.cu) or 2..32 tokens on sm_90 (skinny_wgmma.cu), weights up to
SKINNY_MAX_WEIGHT_BYTES; KDTREE_SKINNY_GEMM=0 / KDTREE_SKINNY_WGMMA=0 turn them off)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from core.env_flags import env_flag
from plugins.common.precision import acc
from plugins.layer_fusion import rms_norm, silu_mul
from plugins.skinny_gemm import skinny_gemm, wgmma_launch
from plugins.skinny_gemm.fragment_order import fragment_copy
from plugins.skinny_gemm.launch import skinny_gemm_frag_cuda
from plugins.skinny_gemm.launch import supports as skinny_supports

__all__ = ["linear", "rms_norm", "swiglu_mlp"]

# KDTREE_SKINNY_GEMM (on unless "0"): bf16 GEMMs on CUDA of at most SKINNY_MAX_TOKENS tokens and weights of at most
# SKINNY_MAX_WEIGHT_BYTES go to plugins/skinny_gemm instead of cuBLAS: where it won on the H200
# (benchmarks/results/skinny-gemm.json: at t = 1 qkv_a 10.9 vs 13.3 µs, q_b 4.9 vs 6.6, o_proj 6.7 vs 6.9, router +
# shared gate_up 7.1 vs 9.0, shared down 3.2 vs 3.9; it lost at t = 16 / 17 on most shapes and at t = 1 on the dense
# MLP's 33 and 66 MB; results/k26-switches.json: the K2.6 AR step -6 %, DDTree rounds +4-10 % with every t <= 32)
SKINNY_GEMM = env_flag("KDTREE_SKINNY_GEMM", True)
SKINNY_LIMITS = (1, 31 << 20)  # (tokens, weight bytes): 32.5 MB takes qkv_a's 30.3 MB, not the dense MLP's 33.0 MB down
SKINNY_MAX_TOKENS, SKINNY_MAX_WEIGHT_BYTES = SKINNY_LIMITS  # the ones in force (a benchmark may widen them)
# KDTREE_SKINNY_WGMMA (on unless "0"): bf16 GEMMs on sm_90 of WGMMA_TOKENS tokens within the same weight limit go to
# plugins/skinny_gemm's skinny_wgmma.cu (weights as wgmma's M side through a TMA ring, k split over CTAs with the last
# one reducing; PDL): the DDTree rounds' and the drafter's GEMMs, which were cuBLAS's.  H100, 40 layers, 4K
# (k26-switches-h100.json call 12): DDTree-16 round 6001.2 -> 5895.7 µs (-1.8 %), the drafter 623.6 -> 609.0; alone
# (skinny-gemm-h100.json, t = 17 against cuBLAS) o_proj 8.58 -> 7.25 µs, the router 10.7 -> 10.3, qkv_a 16.7 / 16.9,
# q_b 5.55 -> 7.12 (its k split costs more than it saves).
SKINNY_WGMMA = env_flag("KDTREE_SKINNY_WGMMA", True)
WGMMA_TOKENS = (2, 32)
# KDTREE_SKINNY_FRAG=1 (off until measured: benchmarks/k26_switches.py's skinny_frag): skinny_gemm's GEMMs of at most
# FRAG_TOKENS tokens read a fragment-order copy of the weight (plugins/skinny_gemm/fragment_order.py, made at the first
# call outside a capture: +66 MB a K2.6 TP8 layer), 512 contiguous bytes a warp load instead of 16 rows' 64 bytes; the
# same bits.  benchmarks/boundary_cost.py measured the row-major pattern at +1.5 µs on qkv_a's 30 MB (H200)
FRAG_WEIGHTS = env_flag("KDTREE_SKINNY_FRAG", False)
FRAG_TOKENS = 8  # one token tile: the compiled _frag variants
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
    Elsewhere both sides are upcast.  With SKINNY_GEMM, a CUDA bf16 product of at most SKINNY_MAX_TOKENS rows and
    SKINNY_MAX_WEIGHT_BYTES of weights is kdtree::skinny_gemm's (same sum in fp32, rounded once; c added in its
    epilogue)."""
    out_dtype = out_dtype or x.dtype
    n, k = w.shape
    if (SKINNY_GEMM or SKINNY_WGMMA) and x.is_cuda:
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
    """linear's product through skinny_wgmma.cu (SKINNY_WGMMA, WGMMA_TOKENS tokens) or kdtree::skinny_gemm
    (SKINNY_GEMM, up to SKINNY_MAX_TOKENS), the first that takes it, or None where neither does."""
    n, k = w.shape
    out_f32 = out_dtype == torch.float32
    if out_dtype not in (x.dtype, torch.float32) or (c is not None and (out_f32 or c.dtype != x.dtype)) \
            or w.numel() * w.element_size() > SKINNY_MAX_WEIGHT_BYTES:
        return None
    x2, c2 = x.reshape(-1, k), (None if c is None else c.reshape(-1, n))  # [t, k], [t, n]
    t = x2.shape[0]
    if SKINNY_WGMMA and WGMMA_TOKENS[0] <= t <= WGMMA_TOKENS[1] and wgmma_launch.supports(x2, w, c2, out_f32):
        return wgmma_launch.skinny_wgmma(x2, w, c2, out_f32).view(*x.shape[:-1], n)
    if SKINNY_GEMM and t <= SKINNY_MAX_TOKENS and skinny_supports(x2, w, c2, out_f32):
        wf = fragment_copy(w) if FRAG_WEIGHTS and t <= FRAG_TOKENS else None
        if wf is not None:
            return skinny_gemm_frag_cuda(x2, wf, n, c2, out_f32).view(*x.shape[:-1], n)
        return skinny_gemm(x2, w, c2, out_f32).view(*x.shape[:-1], n)
    return None


def swiglu_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, c: torch.Tensor | None = None
               ) -> torch.Tensor:
    """x [..., d], gate_up [2i, d] (gate rows | up rows), down [d, i] -> [..., d] (+ c, accumulated into c by
    the down projection's GEMM: c is consumed)."""
    return linear(silu_mul(linear(x, gate_up)), down, c=c)
