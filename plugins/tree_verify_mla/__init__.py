"""tree_verify_mla: attention of tree (or chain) tokens over the latent cache; see reference.py."""

from __future__ import annotations

from typing import Optional

import torch

from plugins.common.op import kdtree_op
from plugins.tree_verify_mla.reference import absorb_values_reference, tree_verify_mla_reference

__all__ = ["tree_verify_mla", "tree_verify_mla_absorb", "check_inputs", "check_absorb"]


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
    """The launcher's kernels (Triton, or tree_verify_wgmma.cu on sm_90 for 33..1024 rows); dtypes or widths they do
    not take (fp64 lossless checks) run the reference."""
    check_inputs(q, cache, cache_lens, tree_kv, tree_mask, out, lse)
    from plugins.tree_verify_mla.launcher import kernel_supports, tree_verify_mla_triton  # triton only on CUDA
    if kernel_supports(q.dtype, q.shape[-1], out.shape[-1]):
        tree_verify_mla_triton(q, cache, cache_lens, tree_kv, tree_mask, scale, out, lse, workspace=workspace)
    else:
        tree_verify_mla_reference(q, cache, cache_lens, tree_kv, tree_mask, scale, out, lse)


def check_absorb(out: torch.Tensor, w_uv: torch.Tensor, out_v: torch.Tensor) -> None:
    """Entry check of the value absorption's tensors (out checked by check_inputs)."""
    b, n, h, d_v = out.shape
    if w_uv.dim() != 3 or w_uv.shape[0] != h or w_uv.shape[2] != d_v or w_uv.stride(2) != 1:
        raise ValueError(f"tree_verify_mla_absorb: w_uv must be [{h}, u, {d_v}] with a contiguous last dim, got "
                         f"{tuple(w_uv.shape)} strides {w_uv.stride()}")
    u = w_uv.shape[1]
    if out_v.shape != (b, n, h, u) or out_v.stride(3) != 1:
        raise ValueError(f"tree_verify_mla_absorb: out_v must be [{b}, {n}, {h}, {u}] with a contiguous last dim, "
                         f"got {tuple(out_v.shape)} strides {out_v.stride()}")
    if w_uv.dtype != out.dtype or out_v.dtype != out.dtype:
        raise ValueError(f"tree_verify_mla_absorb: w_uv and out_v must be out's {out.dtype}, got {w_uv.dtype}, "
                         f"{out_v.dtype}")


def tree_verify_mla_absorb(q: torch.Tensor, cache: torch.Tensor, cache_lens: torch.Tensor, tree_kv: torch.Tensor,
                           tree_mask: torch.Tensor, scale: float, w_uv: torch.Tensor, out: torch.Tensor,
                           lse: torch.Tensor, out_v: torch.Tensor, workspace: Optional[torch.Tensor] = None) -> None:
    """tree_verify_mla, then out_v [b, n, h, u] = out . W_UV^T per head (w_uv [h, u, d_v]; out rounded to its
    dtype first, fp32 sums rounded once: layer_fusion's mla_v_absorb), through the registered op."""
    tree_verify_mla_absorb_op(q, cache, cache_lens, tree_kv, tree_mask, scale, w_uv, out, lse, out_v, workspace)


@kdtree_op("tree_verify_mla_absorb", mutates_args=("out", "lse", "out_v", "workspace"))
def tree_verify_mla_absorb_op(q: torch.Tensor, cache: torch.Tensor, cache_lens: torch.Tensor, tree_kv: torch.Tensor,
                              tree_mask: torch.Tensor, scale: float, w_uv: torch.Tensor, out: torch.Tensor,
                              lse: torch.Tensor, out_v: torch.Tensor, workspace: Optional[torch.Tensor]) -> None:
    """Writes out, lse and out_v; CPU runs the references, CUDA the split kernel and one launch that merges the
    splits and absorbs the values (launcher.tree_verify_mla_triton with w_uv)."""
    check_inputs(q, cache, cache_lens, tree_kv, tree_mask, out, lse)
    check_absorb(out, w_uv, out_v)
    tree_verify_mla_reference(q, cache, cache_lens, tree_kv, tree_mask, scale, out, lse)
    absorb_values_reference(out, w_uv, out_v)


@tree_verify_mla_absorb_op.register_kernel("cuda")
def _tree_verify_mla_absorb_cuda(q: torch.Tensor, cache: torch.Tensor, cache_lens: torch.Tensor,
                                 tree_kv: torch.Tensor, tree_mask: torch.Tensor, scale: float, w_uv: torch.Tensor,
                                 out: torch.Tensor, lse: torch.Tensor, out_v: torch.Tensor,
                                 workspace: Optional[torch.Tensor]) -> None:
    """As _tree_verify_mla_cuda, the values absorbed in the combine's launch; the references where the kernels do
    not take the dtype or widths."""
    check_inputs(q, cache, cache_lens, tree_kv, tree_mask, out, lse)
    check_absorb(out, w_uv, out_v)
    from plugins.tree_verify_mla.launcher import kernel_supports, tree_verify_mla_triton  # triton only on CUDA
    if kernel_supports(q.dtype, q.shape[-1], out.shape[-1]) and out.dtype == q.dtype:
        tree_verify_mla_triton(q, cache, cache_lens, tree_kv, tree_mask, scale, out, lse, workspace=workspace,
                               w_uv=w_uv, out_v=out_v)
    else:
        tree_verify_mla_reference(q, cache, cache_lens, tree_kv, tree_mask, scale, out, lse)
        absorb_values_reference(out, w_uv, out_v)
