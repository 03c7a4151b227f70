"""INT4 weights in compressed-tensors `pack-quantized` form (symmetric, grouped along the input dim).

Layout of one quantised linear weight W [out, in]:
- `weight_packed` int32 [out, in/8]: 8 values per word, value j of a word in bits 4j..4j+3
  (LSB first), each stored offset-coded as q + 8 with q in [-8, 7];
- `weight_scale` [out, in/group] (bf16 in Kimi checkpoints): W[o, i] = q[o, i] * scale[o, i // group];
- `weight_shape` int [2] = (out, in).
"""

from __future__ import annotations

import torch

VALUES_PER_WORD = 8
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # [8] bit offset of value j in its word


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q int8 [..., in] in [-8, 7] (in % 8 == 0) -> int32 [..., in/8], LSB first, offset-coded."""
    if q.dtype != torch.int8:
        raise TypeError(f"pack_int4: q must be int8, got {q.dtype}")
    if q.shape[-1] % VALUES_PER_WORD:
        raise ValueError(f"pack_int4: last dim {q.shape[-1]} is not a multiple of {VALUES_PER_WORD}")
    if q.numel() and (int(q.min()) < -8 or int(q.max()) > 7):
        raise ValueError("pack_int4: values outside [-8, 7]")
    u = (q.to(torch.int32) + 8).reshape(*q.shape[:-1], -1, VALUES_PER_WORD)  # [..., in/8, 8] in [0, 15]
    words = (u << _SHIFTS.to(q.device)).sum(dim=-1, dtype=torch.int64)  # [..., in/8] in [0, 2^32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., in/8] -> int8 [..., in] in [-8, 7] (exact inverse of pack_int4)."""
    if packed.dtype != torch.int32:
        raise TypeError(f"unpack_int4: packed must be int32, got {packed.dtype}")
    nib = (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 0xF  # [..., in/8, 8]
    return (nib - 8).to(torch.int8).reshape(*packed.shape[:-1], -1)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """Exact float32 weights [out, in] from weight_packed [out, in/8] and weight_scale [out, in/group]."""
    q = unpack_int4(packed).to(torch.float32)  # [out, in]
    out_dim, in_dim = q.shape
    if scale.shape != (out_dim, in_dim // group_size):
        raise ValueError(f"dequantize_int4: weight_scale shape {tuple(scale.shape)} != "
                         f"({out_dim}, {in_dim // group_size}) for group size {group_size}")
    s = scale.to(torch.float32).repeat_interleave(group_size, dim=1)  # [out, in]
    return q * s


def quantize_int4(w: torch.Tensor, group_size: int, scale_mantissa_bits: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest INT4: w [out, in] -> (q int8 [out, in], scale fp32 [out, in/group]).

    scale = absmax(group) / 7.  With `scale_mantissa_bits` the scale is rounded to that many
    significant bits, so every dequantised value q * scale is exact in bf16 (used for the tiny
    models' bf16 twins: 3 magnitude bits of q x 4 bits of scale fit bf16's 8).
    """
    out_dim, in_dim = w.shape
    if in_dim % group_size:
        raise ValueError(f"quantize_int4: in dim {in_dim} is not a multiple of group size {group_size}")
    g = w.to(torch.float32).reshape(out_dim, in_dim // group_size, group_size)
    scale = g.abs().amax(dim=-1) / 7.0  # [out, in/group]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    if scale_mantissa_bits is not None:
        exp = torch.floor(torch.log2(scale))
        step = torch.exp2(exp - (scale_mantissa_bits - 1))
        scale = torch.round(scale / step) * step
    q = torch.clamp(torch.round(g / scale.unsqueeze(-1)), -8, 7).to(torch.int8).reshape(out_dim, in_dim)
    return q, scale
