"""FP8 e4m3 weights with one float32 `weight_scale_inv` per (rows x cols) block (DeepSeek-V3 / Kimi K2)."""

from __future__ import annotations

import torch


def dequantize_fp8_block(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """W[o, i] = fp8[o, i] * scale_inv[o // rows, i // cols]; partial edge blocks allowed.

    w: [out, in] float8_e4m3fn; scale_inv: [ceil(out/rows), ceil(in/cols)].  Returns float32 [out, in].
    """
    rows, cols = block
    out_dim, in_dim = w.shape
    want = (-(-out_dim // rows), -(-in_dim // cols))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"dequantize_fp8_block: weight_scale_inv shape {tuple(scale_inv.shape)} != {want} "
                         f"for weight {tuple(w.shape)} and block {block}")
    s = scale_inv.to(torch.float32).repeat_interleave(rows, 0)[:out_dim].repeat_interleave(cols, 1)[:, :in_dim]
    return w.to(torch.float32) * s
