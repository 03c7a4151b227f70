"""The oracle of skinny_gemm: x . w^T (+ c) accumulated in fp32 (fp64 for fp64 inputs) and rounded once."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plugins.common.precision import acc, acc_dtype


def skinny_gemm_reference(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor | None, out_f32: bool) -> torch.Tensor:
    """x [t, k], w [n, k], c [t, n] or None -> [t, n] in fp32 when out_f32 (fp64 for fp64 inputs), else x's dtype:
    what runtime.model.layers.linear computes off CUDA (cuBLAS's addmm with beta = 1 for c)."""
    y = F.linear(acc(x), acc(w))  # [t, n]
    if c is not None:
        y = y + acc(c)
    return y.to(acc_dtype(x.dtype) if out_f32 else x.dtype)
