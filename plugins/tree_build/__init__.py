"""tree_build: drafter logits -> the best-first tree of the B most likely prefixes; see reference.py."""

from __future__ import annotations

from typing import Optional

import torch

from plugins.common.bitmask import mask_words
from plugins.common.op import kdtree_op
from plugins.tree_build.reference import (
    build_from_topk_reference,
    topk_logprobs_reference,
)
from plugins.tree_build.workspace import TreeBuildWorkspace

__all__ = ["tree_build", "tree_build_op", "TreeBuildWorkspace", "topk_logprobs_reference",
           "build_from_topk_reference"]

# The CUDA path is the Triton kernels in kernel.py (imported lazily: CPU installs need no Triton).


def tree_build(logits: torch.Tensor, root: torch.Tensor, start: torch.Tensor, topk: int, tokens: torch.Tensor,
               parents: torch.Tensor, depth: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
               workspace: Optional[torch.Tensor] = None, scores: Optional[torch.Tensor] = None) -> None:
    """Writes the tree of logits [b, D, V] into tokens, parents, depth, positions [b, N] and mask [b, N, w]
    (and, given scores [b, N] fp32, each node's path log-probability) through the registered op (see
    tree_build_op); workspace: a TreeBuildWorkspace's .buffer, or None."""
    # every argument passed explicitly: torch 2.11's mutation bookkeeping indexes the given args only
    tree_build_op(logits, root, start, topk, tokens, parents, depth, positions, mask, workspace, scores)


@kdtree_op("tree_build", mutates_args=("tokens", "parents", "depth", "positions", "mask", "workspace", "scores"))
def tree_build_op(logits: torch.Tensor, root: torch.Tensor, start: torch.Tensor, topk: int, tokens: torch.Tensor,
                  parents: torch.Tensor, depth: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                  workspace: Optional[torch.Tensor], scores: Optional[torch.Tensor]) -> None:
    """logits [b, D, V] draft logits, root [b] int64 bonus tokens, start [b] int64 / int32 position of the root;
    budget B = tokens.shape[1] - 1; candidates per depth K = min(topk, V) (topk = B for DDTree,
    1 for a chain).  Writes tokens, parents, depth, positions [b, N] and mask [b, N, w]; scores [b, N] fp32
    (optional) gets each node's path log-probability under the drafter (root 0; see reference.py).
    Nodes come in score order, so the first b + 1 nodes are the tree of budget b (reference.py).

    workspace: uint8 [nbytes], TreeBuildWorkspace.allocate(b, D, V, B, topk, device).buffer for a capacity
    at least this call's (each of b, D, V, B, topk), so the kernel path allocates nothing; None allocates
    per call.  The CPU path (the reference) checks its size and does not use it."""
    b, d, v = logits.shape
    n = tokens.shape[1]
    if tokens.shape != (b, n) or parents.shape != (b, n) or depth.shape != (b, n) or positions.shape != (b, n):
        raise ValueError(f"tree_build: tokens/parents/depth/positions must be [{b}, N], got {tuple(tokens.shape)}, "
                         f"{tuple(parents.shape)}, {tuple(depth.shape)}, {tuple(positions.shape)}")
    if mask.shape != (b, n, mask_words(n)) or mask.dtype != torch.int64:
        raise ValueError(f"tree_build: mask must be int64 [{b}, {n}, {mask_words(n)}], got {tuple(mask.shape)}")
    if root.shape != (b,) or start.shape != (b,):
        raise ValueError(f"tree_build: root and start must be [{b}], got {tuple(root.shape)}, {tuple(start.shape)}")
    if scores is not None and (scores.shape != (b, n) or scores.dtype != torch.float32):
        raise ValueError(f"tree_build: scores must be fp32 [{b}, {n}], got {scores.dtype} {tuple(scores.shape)}")
    if workspace is not None:
        TreeBuildWorkspace.carve(workspace, b, d, v, n - 1, topk)  # the kernel path's capacity check
    k = min(topk, v)
    lp, ids = topk_logprobs_reference(logits, k)
    outs = build_from_topk_reference(lp, ids, n - 1, root, start)
    for dst, src in zip((tokens, parents, depth, positions, mask, scores), outs):
        if dst is not None:
            dst.copy_(src)


@tree_build_op.register_kernel("cuda")
def _tree_build_cuda(logits: torch.Tensor, root: torch.Tensor, start: torch.Tensor, topk: int, tokens: torch.Tensor,
                     parents: torch.Tensor, depth: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                     workspace: Optional[torch.Tensor], scores: Optional[torch.Tensor]) -> None:
    from plugins.tree_build.kernel import tree_build_triton
    tree_build_triton(logits, root, start, topk, tokens, parents, depth, positions, mask, workspace, scores)
