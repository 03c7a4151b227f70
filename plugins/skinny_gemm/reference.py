"""The oracles of skinny_gemm: x . w^T (+ c) accumulated in fp32 (fp64 for fp64 inputs) and rounded once; and of
skinny_gemm_norm: the residual step (plugins/common/norm.py, as layer_fusion's add_rms_norm forms it) then that
product."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plugins.common.precision import acc, acc_dtype
from plugins.common.norm import add_rms_norm_reference, rms_norm_reference


def skinny_gemm_reference(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor | None, out_f32: bool) -> torch.Tensor:
    """x [t, k], w [n, k], c [t, n] or None -> [t, n] in fp32 when out_f32 (fp64 for fp64 inputs), else x's dtype:
    what runtime.model.layers.linear computes off CUDA (cuBLAS's addmm with beta = 1 for c)."""
    y = F.linear(acc(x), acc(w))  # [t, n]
    if c is not None:
        y = y + acc(c)
    return y.to(acc_dtype(x.dtype) if out_f32 else x.dtype)


def skinny_gemm_norm_reference(delta: torch.Tensor, res: torch.Tensor | None, nw: torch.Tensor, eps: float,
                               w: torch.Tensor, out_f32: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """delta, res [t, k] (res None: s = delta), nw [k], w [n, k] -> (y = x' . w^T [t, n], s = res + delta,
    x' = rms_norm(s) * nw [t, k])."""
    if res is None:
        s, hn = delta.clone(), rms_norm_reference(delta, nw, eps)  # s a new tensor, as the kernel's
    else:
        s, hn = add_rms_norm_reference(res, delta, None, nw, eps)
    return skinny_gemm_reference(hn, w, None, out_f32), s, hn
