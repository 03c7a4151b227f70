"""Accumulation precision of the references: fp32 for bf16/fp16/fp32 inputs, fp64 kept as fp64
(the lossless tests run the reference in fp64, where fp32 rounding would flip near-tied routing)."""

from __future__ import annotations

import torch

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what the Triton kernels take; fp64 runs references


def acc(t: torch.Tensor) -> torch.Tensor:
    """t in its accumulation dtype: float64 stays, everything else becomes float32."""
    return t if t.dtype == torch.float64 else t.float()


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """acc's dtype for a tensor of `dtype`, without converting anything (acc(x).dtype would copy x: one kernel)."""
    return dtype if dtype == torch.float64 else torch.float32
