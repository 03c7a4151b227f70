"""skinny_gemm: the decode round's dense GEMMs for a few tokens, y [t, n] = x [t, k] . w [n, k]^T (+ c), fp32
accumulation, bf16 or fp32 out; a CUDA C kernel (skinny_gemm.cu) that streams the weights from HBM into mma.sync
registers with no shared-memory staging, and whose sum order does not depend on t (launch.py).

`kdtree::skinny_gemm(x, w, c, out_f32)`: the reference on CPU (reference.py), the kernel on CUDA where it takes the
inputs (launch.supports), else the reference there too.  runtime.model.layers.linear calls it on CUDA only with
KDTREE_SKINNY_GEMM=1, until benchmarks/skinny_gemm.py and the rank benchmark show it beats cuBLAS.  See NOTES.md."""

from __future__ import annotations

from typing import Optional

import torch

from plugins.common.op import kdtree_op
from plugins.skinny_gemm.reference import skinny_gemm_reference

__all__ = ["skinny_gemm", "skinny_gemm_op"]


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor | None = None, out_f32: bool = False
                ) -> torch.Tensor:
    """x [t, k] . w [n, k]^T (+ c [t, n]) -> [t, n] (see skinny_gemm_op)."""
    return skinny_gemm_op(x, w, c, out_f32)


def _check(x: torch.Tensor, w: torch.Tensor, c: Optional[torch.Tensor], out_f32: bool) -> None:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"skinny_gemm: x must be [t, k] and w [n, k], got {list(x.shape)} and {list(w.shape)}")
    if c is not None and (out_f32 or tuple(c.shape) != (x.shape[0], w.shape[0]) or c.dtype != x.dtype):
        raise ValueError(f"skinny_gemm: c must be {x.dtype} [{x.shape[0]}, {w.shape[0]}] with a model-dtype output, "
                         f"got {c.dtype} {list(c.shape)} (out_f32={out_f32})")


@kdtree_op("skinny_gemm", mutates_args=())
def skinny_gemm_op(x: torch.Tensor, w: torch.Tensor, c: Optional[torch.Tensor], out_f32: bool) -> torch.Tensor:
    """x [t, k], w [n, k], c [t, n] in x's dtype or None -> [t, n], fp32 (fp64 for fp64) when out_f32, else x's
    dtype: x . w^T + c summed in fp32 and rounded once."""
    _check(x, w, c, out_f32)
    return skinny_gemm_reference(x, w, c, out_f32)


@skinny_gemm_op.register_fake
def _(x, w, c, out_f32):
    return x.new_empty(x.shape[0], w.shape[0], dtype=torch.float32 if out_f32 else x.dtype)


@skinny_gemm_op.register_kernel("cuda")
def _(x, w, c, out_f32):
    _check(x, w, c, out_f32)
    from plugins.skinny_gemm.launch import skinny_gemm_cuda, supports
    if supports(x, w, c, out_f32):
        return skinny_gemm_cuda(x, w, c, out_f32)
    return skinny_gemm_reference(x, w, c, out_f32)
