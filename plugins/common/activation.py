"""SiLU * up, the SwiGLU MLP's activation, in torch: the reference of every kernel that forms it (layer_fusion's
silu_mul, moe_w4a16's routing kernel for the shared expert; their Triton form is activation_kernel.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_reference(gate_up: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """gate_up [t, 2i] (gate columns, then up columns) -> silu(gate) * up [t, i].  out_dtype: gate_up is first
    rounded to it (a GEMM's fp32 output taken as the model-dtype output it stands for)."""
    if out_dtype is not None:
        gate_up = gate_up.to(out_dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
