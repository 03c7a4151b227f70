"""tree_verify_mla: attention of tree (or chain) tokens over the latent cache; see reference.py."""

from __future__ import annotations

from typing import Optional

import torch

from plugins.common.op import kdtree_op
from plugins.tree_verify_mla.reference import tree_verify_mla_reference

__all__ = ["tree_verify_mla", "tree_verify_mla_partials", "check_inputs"]


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
        raise ValueError(f"tree_verify_mla: cache_lens must be int32 [{b}], got {cache_lens.dtype} {tuple(cache_lens.shape)}")
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
    """The Triton kernel; dtypes or widths it does not take (fp64 lossless checks) run the reference."""
    check_inputs(q, cache, cache_lens, tree_kv, tree_mask, out, lse)
    from plugins.tree_verify_mla.launcher import kernel_supports, tree_verify_mla_triton  # triton only on CUDA
    if kernel_supports(q.dtype, q.shape[-1], out.shape[-1]):
        tree_verify_mla_triton(q, cache, cache_lens, tree_kv, tree_mask, scale, out, lse, workspace=workspace)
    else:
        tree_verify_mla_reference(q, cache, cache_lens, tree_kv, tree_mask, scale, out, lse)


def tree_verify_mla_partials(q: torch.Tensor, cache: torch.Tensor, cache_lens: torch.Tensor, tree_kv: torch.Tensor,
                             tree_mask: torch.Tensor, scale: float, out: torch.Tensor, lse: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention without its split combine, for a caller that merges the splits itself (layer_fusion's
    mla_combine_v_absorb): (o_part [b, s, n*h, d_v], l_part [b, s, n*h]) fp32, see tree_verify_mla_partials_op."""
    return tree_verify_mla_partials_op(q, cache, cache_lens, tree_kv, tree_mask, scale, out, lse)


@kdtree_op("tree_verify_mla_partials", mutates_args=("out", "lse"))
def tree_verify_mla_partials_op(q: torch.Tensor, cache: torch.Tensor, cache_lens: torch.Tensor, tree_kv: torch.Tensor,
                                tree_mask: torch.Tensor, scale: float, out: torch.Tensor, lse: torch.Tensor
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Either writes out [b, n, h, d_v] and lse [b, n, h] as tree_verify_mla_op and returns no partials (s = 0: the
    reference, and the kernel where its plan has one split), or leaves them and returns the split kernel's
    partials (CUDA, s > 1 splits; views of one buffer allocated here): o_part [b, s, n*h, d_v], each split's
    normalised output (row = node * h + head; a split that saw no key leaves its row unwritten), and l_part
    [b, s, n*h], its base-2 lse (-inf for such a split).  Their combine, sum_s 2^(l_s - max) o_s / sum_s
    2^(l_s - max), is the attention."""
    check_inputs(q, cache, cache_lens, tree_kv, tree_mask, out, lse)
    tree_verify_mla_reference(q, cache, cache_lens, tree_kv, tree_mask, scale, out, lse)
    return _partials_like(out, 0)


@tree_verify_mla_partials_op.register_fake
def _(q, cache, cache_lens, tree_kv, tree_mask, scale, out, lse):
    b, n, h, d_v = out.shape
    s = 0
    if q.is_cuda:
        from plugins.tree_verify_mla.launcher import kernel_supports, plan
        if kernel_supports(q.dtype, q.shape[-1], d_v) and b * n * h:
            s = plan(b, n, h, cache.shape[1], q.dtype, q.device, d_qk=q.shape[-1], d_v=d_v).num_splits
    return _partials_like(out, 0 if s == 1 else s)


@tree_verify_mla_partials_op.register_kernel("cuda")
def _tree_verify_mla_partials_cuda(q: torch.Tensor, cache: torch.Tensor, cache_lens: torch.Tensor,
                                   tree_kv: torch.Tensor, tree_mask: torch.Tensor, scale: float, out: torch.Tensor,
                                   lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The split kernel alone (launcher.tree_verify_mla_triton(combine=False)); the reference where it does not run."""
    check_inputs(q, cache, cache_lens, tree_kv, tree_mask, out, lse)
    from plugins.tree_verify_mla.launcher import kernel_supports, tree_verify_mla_triton
    if not kernel_supports(q.dtype, q.shape[-1], out.shape[-1]):
        tree_verify_mla_reference(q, cache, cache_lens, tree_kv, tree_mask, scale, out, lse)
        return _partials_like(out, 0)
    parts = tree_verify_mla_triton(q, cache, cache_lens, tree_kv, tree_mask, scale, out, lse, combine=False)
    return parts if parts is not None else _partials_like(out, 0)


def _partials_like(out: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (o_part [b, s, n*h, d_v], l_part [b, s, n*h]) fp32 for out [b, n, h, d_v]; s = 0: the result is in
    out / lse."""
    b, n, h, d_v = out.shape
    return out.new_empty(b, s, n * h, d_v, dtype=torch.float32), out.new_empty(b, s, n * h, dtype=torch.float32)
