"""tree_build: drafter logits -> the best-first tree of the B most likely prefixes; see reference.py."""

from __future__ import annotations

import torch

from plugins.bitmask import mask_words
from plugins.tree_build.reference import build_from_topk_reference, topk_logprobs_reference

__all__ = ["tree_build", "topk_logprobs_reference", "build_from_topk_reference"]

# The CUDA path is the Triton kernels in kernel.py (imported lazily: CPU installs need no Triton).


@torch.library.custom_op("kdtree::tree_build", mutates_args=("tokens", "parents", "depth", "positions", "mask"))
def tree_build(logits: torch.Tensor, root: torch.Tensor, start: torch.Tensor, topk: int, tokens: torch.Tensor,
               parents: torch.Tensor, depth: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> None:
    """logits [b, D, V] draft logits, root [b] int64 bonus tokens, start [b] position of the root;
    budget B = tokens.shape[1] - 1; candidates per depth K = min(topk, V) (topk = B for DDTree,
    1 for a chain).  Writes tokens, parents, depth, positions [b, N] and mask [b, N, w]."""
    b, d, v = logits.shape
    n = tokens.shape[1]
    if tokens.shape != (b, n) or parents.shape != (b, n) or depth.shape != (b, n) or positions.shape != (b, n):
        raise ValueError(f"tree_build: tokens/parents/depth/positions must be [{b}, N], got {tuple(tokens.shape)}, "
                         f"{tuple(parents.shape)}, {tuple(depth.shape)}, {tuple(positions.shape)}")
    if mask.shape != (b, n, mask_words(n)) or mask.dtype != torch.int64:
        raise ValueError(f"tree_build: mask must be int64 [{b}, {n}, {mask_words(n)}], got {tuple(mask.shape)}")
    if root.shape != (b,) or start.shape != (b,):
        raise ValueError(f"tree_build: root and start must be [{b}], got {tuple(root.shape)}, {tuple(start.shape)}")
    k = min(topk, v)
    lp, ids = topk_logprobs_reference(logits, k)
    outs = build_from_topk_reference(lp, ids, n - 1, root, start)
    for dst, src in zip((tokens, parents, depth, positions, mask), outs):
        dst.copy_(src)


@tree_build.register_kernel("cuda")
def _tree_build_cuda(logits: torch.Tensor, root: torch.Tensor, start: torch.Tensor, topk: int, tokens: torch.Tensor,
                     parents: torch.Tensor, depth: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> None:
    from plugins.tree_build.kernel import tree_build_triton
    tree_build_triton(logits, root, start, topk, tokens, parents, depth, positions, mask)
