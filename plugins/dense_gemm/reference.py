"""The semantics of kdtree::skinny_linear (torch, every device): a tiny-M projection y = x . W^T (+ c).

Letters: t tokens (1 for AR decode, 2..65 for a speculative round, up to 257), n output features (W's rows),
k input features.  x [t, k] (row stride may exceed k), w [n, k] (nn.Linear's layout, contiguous), c [t, n].

The products of the stored values are summed in fp32 (in fp64 when x or w is fp64: the GPU test's reference),
c is added in the same precision, and the sum is rounded once to out_dtype: runtime/model/layers.linear's
contract, so the kernel may stand in for cuBLAS's F.linear / mm(out_dtype=fp32) / addmm without changing what
a caller rounds where.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def skinny_linear_reference(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor | None,
                            out_dtype: torch.dtype) -> torch.Tensor:
    """x [t, k], w [n, k], c [t, n] or None -> [t, n] out_dtype = round(x . w^T + c) (one rounding)."""
    dt = torch.float64 if torch.float64 in (x.dtype, w.dtype) else torch.float32  # fp64 when either side is
    y = F.linear(x.to(dt), w.to(dt))  # [t, n]
    if c is not None:
        y = y + c.to(dt)
    return y.to(out_dtype)
