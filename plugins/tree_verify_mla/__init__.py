"""tree_verify_mla: attention of tree (or chain) tokens over the latent cache; see reference.py."""

from __future__ import annotations

from typing import Optional

import torch

from plugins.common.op import kdtree_op
from plugins.tree_verify_mla.reference import tree_verify_mla_reference

__all__ = ["tree_verify_mla", "check_inputs"]


def check_inputs(q, cache, cache_lens, tree_kv, tree_mask, out, lse) -> None:
    """Entry check: ranks, dtypes and matching sizes, with messages naming the tensor."""
    if q.dim() != 4:
        raise ValueError(f"tree_verify_mla: q must be [b, n, h, d_qk], got shape {tuple(q.shape)}")
    b, n, h, d_qk = q.shape
    if cache.dim() != 3 or cache.shape[0] != b or cache.shape[2] != d_qk:
        raise ValueError(f"tree_verify_mla: cache must be [{b}, l_max, {d_qk}], got {tuple(cache.shape)}")
    if tree_kv.shape != (b, n, d_qk):
        raise ValueError(f"tree_verify_mla: tree_kv must be [{b}, {n}, {d_qk}], got {tuple(tree_kv.shape)}")
    if cache_lens.shape != (b,) or cache_lens.dtype != torch.int32:
        raise ValueError(f"tree_verify_mla: cache_lens must be int32 [{b}], got "
                         f"{cache_lens.dtype} {tuple(cache_lens.shape)}")
    w = (n + 63) // 64
    if tree_mask.shape != (b, n, w) or tree_mask.dtype != torch.int64:
        raise ValueError(f"tree_verify_mla: tree_mask must be int64 [{b}, {n}, {w}], got {tree_mask.dtype} "
                         f"{tuple(tree_mask.shape)}")
    if out.dim() != 4 or out.shape[:3] != (b, n, h) or out.shape[3] > d_qk:
        raise ValueError(f"tree_verify_mla: out must be [{b}, {n}, {h}, d_v <= {d_qk}], got {tuple(out.shape)}")
    if lse.shape != (b, n, h) or lse.dtype != torch.float32:
        raise ValueError(f"tree_verify_mla: lse must be fp32 [{b}, {n}, {h}], got {lse.dtype} {tuple(lse.shape)}")
    if cache.dtype != q.dtype or tree_kv.dtype != q.dtype:
        raise ValueError(f"tree_verify_mla: q, cache, tree_kv must share a dtype, got {q.dtype}, {cache.dtype}, "
                         f"{tree_kv.dtype}")


def tree_verify_mla(q: torch.Tensor, cache: torch.Tensor, cache_lens: torch.Tensor, tree_kv: torch.Tensor,
                    tree_mask: torch.Tensor, scale: float, out: torch.Tensor, lse: torch.Tensor,
                    workspace: Optional[torch.Tensor] = None) -> None:
    """Writes out [b, n, h, d_v] and lse [b, n, h] through the registered op (see tree_verify_mla_op)."""
    # every argument passed explicitly: torch 2.11's mutation bookkeeping indexes the given args only
    tree_verify_mla_op(q, cache, cache_lens, tree_kv, tree_mask, scale, out, lse, workspace)


@kdtree_op("tree_verify_mla", mutates_args=("out", "lse", "workspace"))
def tree_verify_mla_op(q: torch.Tensor, cache: torch.Tensor, cache_lens: torch.Tensor, tree_kv: torch.Tensor,
                       tree_mask: torch.Tensor, scale: float, out: torch.Tensor, lse: torch.Tensor,
                       workspace: Optional[torch.Tensor]) -> None:
    """Writes out [b, n, h, d_v] and lse [b, n, h]; CPU runs the reference, CUDA the Triton kernel.

    workspace (CUDA only, optional): fp32 scratch of launcher.workspace_numel(...) elements for these
    static shapes, so the op allocates nothing inside a CUDA graph; None allocates it per call."""
    check_inputs(q, cache, cache_lens, tree_kv, tree_mask, out, lse)
    tree_verify_mla_reference(q, cache, cache_lens, tree_kv, tree_mask, scale, out, lse)


@tree_verify_mla_op.register_kernel("cuda")
def _tree_verify_mla_cuda(q: torch.Tensor, cache: torch.Tensor, cache_lens: torch.Tensor, tree_kv: torch.Tensor,
                          tree_mask: torch.Tensor, scale: float, out: torch.Tensor, lse: torch.Tensor,
                          workspace: Optional[torch.Tensor]) -> None:
    """The launcher's kernels (Triton, or tree_verify_wgmma.cu on sm_90 for 33..1024 rows); dtypes or widths they do
    not take (fp64 lossless checks) run the reference."""
    check_inputs(q, cache, cache_lens, tree_kv, tree_mask, out, lse)
    from plugins.tree_verify_mla.launcher import kernel_supports, tree_verify_mla_triton  # triton only on CUDA
    if kernel_supports(q.dtype, q.shape[-1], out.shape[-1]):
        tree_verify_mla_triton(q, cache, cache_lens, tree_kv, tree_mask, scale, out, lse, workspace=workspace)
    else:
        tree_verify_mla_reference(q, cache, cache_lens, tree_kv, tree_mask, scale, out, lse)
