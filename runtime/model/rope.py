"""Rotary position embedding with YaRN, in transformers' DeepseekV3 semantics.

The checkpoint stores the r rope dims of q_pe / k_pe interleaved: pairs (x0, x1), (x2, x3), ...
each rotated by one frequency.  apply_rope returns them de-interleaved (all first elements of the
pairs, then all second elements), for q and k alike, so q.k is unchanged and the latent cache
holds k_pe in that de-interleaved layout.
"""

from __future__ import annotations

import math

import torch

from core.config import RopeConfig
from plugins.layer_fusion import rope_cos_sin, rotate_reference


def inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """[dim/2] fp32 inverse frequencies (YaRN-blended when rope.kind == 'yarn')."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    if rope.kind != "yarn":
        return extrapolation
    interpolation = 1.0 / (rope.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight


class Rope:
    """cos/sin for given positions, computed exactly as transformers does (fp32 position x inv_freq)."""

    def __init__(self, rope: RopeConfig, dim: int, interleave: bool, device: torch.device | str = "cpu"):
        self.inv_freq = inv_freq(rope, dim).to(device)  # [r/2]
        self.scale = rope.cos_sin_scale()
        self.interleave = interleave

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [b, n] -> cos, sin [b, n, r/2] in `dtype` (one kernel on CUDA: plugins/layer_fusion)."""
        return rope_cos_sin(positions, self.inv_freq, self.scale, dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [b, n, (h,) r] with cos/sin [b, n, r/2] -> rotated, de-interleaved [b, n, (h,) r]."""
        if x.dim() == 4:
            cos, sin = cos[:, :, None], sin[:, :, None]
        return rotate_reference(x, cos, sin, self.interleave)
