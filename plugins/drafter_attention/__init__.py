"""drafter_attention: the DFlash drafter's block attention over its KV cache (reference.py; kernel.py on CUDA).

Registered as kdtree::drafter_attention.  CUDA tensors of bf16 / fp16 / fp32 with a power-of-two head_dim of
16..256 run the Triton kernels (2 launches); everything else (CPU, fp64) the torch reference.
"""

from __future__ import annotations

import torch

from plugins.common.op import kdtree_op
from plugins.common.precision import KERNEL_DTYPES
from plugins.drafter_attention.reference import drafter_attention_reference

__all__ = ["drafter_attention", "drafter_attention_op"]


def drafter_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, visible: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """q [b, s, h, e], k_cache / v_cache [b, cap, g, e], visible [b] int32 / int64 (each >= 1: rows
    [0, min(visible[r], cap)) are attended) -> [b, s, h*e] in q's dtype."""
    _check(q, k_cache, v_cache, visible)
    if not q.is_cuda:
        return drafter_attention_reference(q, k_cache, v_cache, visible, scale)
    return drafter_attention_op(q, k_cache, v_cache, visible, scale)


@kdtree_op("drafter_attention", mutates_args=())
def drafter_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, visible: torch.Tensor,
                         scale: float) -> torch.Tensor:
    return drafter_attention_reference(q, k_cache, v_cache, visible, scale)


@drafter_attention_op.register_fake
def _(q, k_cache, v_cache, visible, scale):
    b, s, h, e = q.shape
    return q.new_empty(b, s, h * e)


@drafter_attention_op.register_kernel("cuda")
def _drafter_attention_cuda(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, visible: torch.Tensor,
                            scale: float) -> torch.Tensor:
    if not kernel_supports(q, k_cache, v_cache):
        return drafter_attention_reference(q, k_cache, v_cache, visible, scale)
    from plugins.drafter_attention.kernel import drafter_attention_triton
    b, s, h, e = q.shape
    out = torch.empty(b, s, h * e, dtype=q.dtype, device=q.device)
    drafter_attention_triton(q, k_cache, v_cache, visible, scale, out)
    return out


def kernel_supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    e = q.shape[-1]
    return (q.dtype in KERNEL_DTYPES and k_cache.dtype == v_cache.dtype == q.dtype and 16 <= e <= 256
            and e & (e - 1) == 0 and q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, visible: torch.Tensor) -> None:
    if q.dim() != 4 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"drafter_attention: need q [b, s, h, e] and k_cache = v_cache [b, cap, g, e], got q "
                         f"{tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    b, s, h, e = q.shape
    g = k_cache.shape[2]
    if k_cache.shape[0] != b or k_cache.shape[3] != e or g == 0 or h % g:
        raise ValueError(f"drafter_attention: k_cache {tuple(k_cache.shape)} does not match q {tuple(q.shape)} "
                         f"(same b and e, kv heads dividing the {h} query heads)")
    if visible.shape != (b,) or visible.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"drafter_attention: visible must be int32 / int64 [{b}], got {visible.dtype} "
                         f"{tuple(visible.shape)}")
