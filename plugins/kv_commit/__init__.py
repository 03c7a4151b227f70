"""kv_commit: compact accepted tree rows into the committed latent cache; see reference.py."""

from __future__ import annotations

import torch

from plugins.common.op import kdtree_op
from plugins.kv_commit.reference import kv_commit_reference

__all__ = ["kv_commit", "kv_commit_op"]

# The CUDA path is the Triton kernels in kernel.py (imported lazily: CPU installs need no Triton).


def kv_commit(cache: torch.Tensor, cache_lens: torch.Tensor, scratch: torch.Tensor, accept_idx: torch.Tensor,
              accept_len: torch.Tensor, feats: torch.Tensor | None = None,
              ctx_feats: torch.Tensor | None = None, advance: bool = True) -> None:
    """Appends scratch[:, r, accept_idx[r, :accept_len[r]]] to cache[:, r], advances cache_lens (advance False:
    the caller's next kernel does, e.g. an AR step's round_emit) and, given feats [b, n, f], gathers the accepted
    rows into ctx_feats [b, a, f]."""
    # every argument passed explicitly: torch 2.11's mutation bookkeeping indexes the given args only
    kv_commit_op(cache, cache_lens, scratch, accept_idx, accept_len, feats, ctx_feats, advance)


@kdtree_op("kv_commit", mutates_args=("cache", "cache_lens", "ctx_feats"))
def kv_commit_op(cache: torch.Tensor, cache_lens: torch.Tensor, scratch: torch.Tensor, accept_idx: torch.Tensor,
                 accept_len: torch.Tensor, feats: torch.Tensor | None, ctx_feats: torch.Tensor | None,
                 advance: bool) -> None:
    """The registered op (no defaults: call kv_commit()).  Appends scratch[:, r, accept_idx[r, :accept_len[r]]] to
    cache[:, r], advances cache_lens and,
    given feats [b, n, f], gathers the accepted rows into ctx_feats [b, a, f]."""
    y, b, l_max, d_qk = cache.shape
    if scratch.dim() != 4 or scratch.shape[0] != y or scratch.shape[1] != b or scratch.shape[3] != d_qk:
        raise ValueError(f"kv_commit: scratch must be [{y}, {b}, n, {d_qk}], got {tuple(scratch.shape)}")
    if accept_idx.dim() != 2 or accept_idx.shape[0] != b or accept_idx.dtype != torch.int32:
        raise ValueError(f"kv_commit: accept_idx must be int32 [{b}, a], got "
                         f"{accept_idx.dtype} {tuple(accept_idx.shape)}")
    if accept_len.shape != (b,) or accept_len.dtype != torch.int32 or cache_lens.shape != (b,) \
            or cache_lens.dtype != torch.int32:
        raise ValueError("kv_commit: accept_len and cache_lens must be int32 [b]")
    if (feats is None) != (ctx_feats is None):
        raise ValueError("kv_commit: give both feats and ctx_feats or neither")
    if feats is not None and (feats.shape[0] != b or feats.shape[1] > scratch.shape[2] or ctx_feats.shape[0] != b
                              or ctx_feats.shape[1] != accept_idx.shape[1] or ctx_feats.shape[2] != feats.shape[2]):
        raise ValueError(f"kv_commit: feats must be [{b}, <= n, f] and ctx_feats [{b}, a, f], got "
                         f"{tuple(feats.shape)}, {tuple(ctx_feats.shape)}")
    kv_commit_reference(cache, cache_lens, scratch, accept_idx, accept_len, feats, ctx_feats, advance)


@kv_commit_op.register_kernel("cuda")
def _kv_commit_cuda(cache: torch.Tensor, cache_lens: torch.Tensor, scratch: torch.Tensor, accept_idx: torch.Tensor,
                    accept_len: torch.Tensor, feats: torch.Tensor | None, ctx_feats: torch.Tensor | None,
                    advance: bool) -> None:
    from plugins.kv_commit.kernel import kv_commit_triton
    kv_commit_triton(cache, cache_lens, scratch, accept_idx, accept_len, feats, ctx_feats, advance=advance)
