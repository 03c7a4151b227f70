"""tree_accept: the accepted path through a verified tree and the next bonus token; see reference.py."""

from __future__ import annotations

import torch

from plugins.common.op import kdtree_op
from plugins.tree_accept.reference import tree_accept_reference

__all__ = ["tree_accept"]

# The CUDA path is the Triton kernel in kernel.py (imported lazily: CPU installs need no Triton).


@kdtree_op("tree_accept", mutates_args=("accept_idx", "accept_len", "bonus"))
def tree_accept(posterior: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, accept_idx: torch.Tensor,
                accept_len: torch.Tensor, bonus: torch.Tensor) -> None:
    """Writes accept_idx [b, a], accept_len [b] and bonus [b] from posterior/tokens/parents [b, N]."""
    b, n = tokens.shape
    if posterior.shape != (b, n) or parents.shape != (b, n):
        raise ValueError(f"tree_accept: posterior and parents must be [{b}, {n}], got {tuple(posterior.shape)}, "
                         f"{tuple(parents.shape)}")
    if accept_idx.dim() != 2 or accept_idx.shape[0] != b or accept_len.shape != (b,) or bonus.shape != (b,):
        raise ValueError("tree_accept: accept_idx must be [b, a], accept_len and bonus [b]")
    tree_accept_reference(posterior, tokens, parents, accept_idx, accept_len, bonus)


@tree_accept.register_kernel("cuda")
def _tree_accept_cuda(posterior: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, accept_idx: torch.Tensor,
                      accept_len: torch.Tensor, bonus: torch.Tensor) -> None:
    from plugins.tree_accept.kernel import tree_accept_triton
    tree_accept_triton(posterior, tokens, parents, accept_idx, accept_len, bonus)
