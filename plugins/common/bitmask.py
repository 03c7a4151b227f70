"""Packed ancestor bitmasks shared by the tree ops.

A tree of n nodes carries mask [b, n, w] int64 with w = ceil(n / 64): bit (j % 64) of word j // 64
in row i is set iff node j is node i itself or one of its ancestors.  A chain (prefill, AR) is
the lower-triangular mask.
"""

from __future__ import annotations

import torch


def mask_words(n: int) -> int:
    return (n + 63) // 64


def unpack_mask(mask: torch.Tensor, n: int) -> torch.Tensor:
    """[..., w] int64 -> bool [..., n]."""
    bits = (mask[..., :, None] >> torch.arange(64, device=mask.device)) & 1  # [..., w, 64]
    return bits.flatten(-2)[..., :n].bool()


def pack_mask(dense: torch.Tensor) -> torch.Tensor:
    """bool [..., n] -> [..., ceil(n/64)] int64 (inverse of unpack_mask)."""
    n = dense.shape[-1]
    w = mask_words(n)
    padded = torch.zeros(*dense.shape[:-1], w * 64, dtype=torch.int64, device=dense.device)
    padded[..., :n] = dense.to(torch.int64)
    bits = padded.view(*dense.shape[:-1], w, 64) << torch.arange(64, device=dense.device)
    return bits.sum(dim=-1)  # int64 wraps for bit 63 exactly as two's complement


def causal_mask(b: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[b, n, w] chain mask: token i sees tokens 0..i of its own block."""
    dense = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return pack_mask(dense).unsqueeze(0).expand(b, n, -1).contiguous()
