"""RMSNorm and a layer's residual step, in torch: the reference of every kernel that forms them (layer_fusion's
add_rms_norm and rms_norm, skinny_gemm's residual-norm variants)."""

from __future__ import annotations

import torch

from plugins.common.precision import acc


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalise in fp32 (fp64 stays fp64), cast back, then scale.  x [..., d]."""
    xf = acc(x)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, delta: torch.Tensor, delta2: torch.Tensor | None, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual step: s = x + (delta + delta2) (delta2 optional, summed first), then (s, rms_norm(s))."""
    if delta2 is not None:
        delta = delta + delta2
    s = x + delta  # [..., d]
    return s, rms_norm_reference(s, weight, eps)
