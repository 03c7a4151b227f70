"""Small building blocks shared by the target and drafter forward passes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plugins.common.precision import acc


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalise in fp32, cast back, then scale."""
    xf = acc(x)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def swiglu_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """x [..., d], gate_up [2i, d] (gate rows | up rows), down [d, i] -> [..., d]."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)
