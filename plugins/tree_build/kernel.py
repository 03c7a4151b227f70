"""tree_build on the GPU (Triton): entry checks, workspace, and the two stages.

Eight launches, no host synchronisation, no data-dependent shapes: capturable in a CUDA graph (pass
the buffer of a TreeBuildWorkspace allocated once to allocate nothing).  Under TRITON_INTERPRET=1 the
same code runs on CPU tensors (the CI check of the kernel logic).
"""

from __future__ import annotations

import torch

from plugins.common.bitmask import mask_words
from plugins.tree_build.topk_kernel import topk_logprobs_triton
from plugins.tree_build.tree_kernel import build_tree_triton
from plugins.tree_build.workspace import TreeBuildWorkspace


def prefix_count(k: int, depth: int, cap: int) -> int:
    """min(cap, sum_{d=1..depth} k^d): how many prefixes exist, saturated at cap."""
    total, level = 0, 1
    for _ in range(depth):
        level = min(level * k, cap)
        total = min(total + level, cap)
    return total


def check_tree_build_args(logits, root, start, topk, tokens, parents, depth, positions, mask) -> None:
    if logits.dim() != 3 or logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"tree_build: logits must be [b, D, V] fp32/bf16/fp16, got {tuple(logits.shape)} "
                         f"{logits.dtype}")
    b, d, v = logits.shape
    n = tokens.shape[1] if tokens.dim() == 2 else -1
    want = {"tokens": (tokens, (b, n), torch.int64), "parents": (parents, (b, n), torch.int32),
            "depth": (depth, (b, n), torch.int32), "positions": (positions, (b, n), torch.int64),
            "mask": (mask, (b, n, mask_words(n)), torch.int64), "root": (root, (b,), torch.int64),
            "start": (start, (b,), (torch.int64, torch.int32))}  # start: a cache's int32 lengths as they are
    for name, (t, shape, dtype) in want.items():
        if tuple(t.shape) != shape or t.dtype not in (dtype if isinstance(dtype, tuple) else (dtype,)) \
                or not t.is_contiguous() or t.device != logits.device:
            raise ValueError(f"tree_build: {name} must be contiguous {dtype} {list(shape)} on {logits.device}, "
                             f"got {t.dtype} {list(t.shape)} on {t.device}")
    budget = n - 1
    if budget < 1:
        raise ValueError(f"tree_build: budget N - 1 must be >= 1, got tokens [{b}, {n}]")
    k = min(topk, v)
    if prefix_count(k, d, budget) < budget:
        raise ValueError(f"tree_build: only {prefix_count(k, d, budget)} prefixes exist for budget {budget} "
                         f"(depth {d}, {k} candidates per depth)")


def tree_build_triton(logits: torch.Tensor, root: torch.Tensor, start: torch.Tensor, topk: int,
                      tokens: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor, positions: torch.Tensor,
                      mask: torch.Tensor, workspace: torch.Tensor | None = None,
                      scores: torch.Tensor | None = None) -> TreeBuildWorkspace:
    """Same contract as kdtree::tree_build (see reference.py); writes the outputs in place and returns the
    workspace views used (ws.lp / ws.ids then hold the sorted candidates [b * D, K], K = min(topk, V, B)).
    workspace: a TreeBuildWorkspace's .buffer allocated for at least this call's shapes; None allocates one.
    scores: [b, N] fp32, each node's path log-probability (root 0), or None."""
    check_tree_build_args(logits, root, start, topk, tokens, parents, depth, positions, mask)
    b, d, v = logits.shape
    if scores is not None and (tuple(scores.shape) != tuple(tokens.shape) or scores.dtype != torch.float32
                               or not scores.is_contiguous() or scores.device != logits.device):
        raise ValueError(f"tree_build: scores must be contiguous torch.float32 {list(tokens.shape)} on "
                         f"{logits.device}, got {scores.dtype} {list(scores.shape)} on {scores.device}")
    budget = tokens.shape[1] - 1
    if workspace is None:
        ws = TreeBuildWorkspace.allocate(b, d, v, budget, topk, logits.device)
    else:
        if workspace.device != logits.device:
            raise ValueError(f"tree_build: workspace is on {workspace.device}, logits on {logits.device}")
        ws = TreeBuildWorkspace.carve(workspace, b, d, v, budget, topk)
    topk_logprobs_triton(logits.contiguous().view(b * d, v), ws.k, ws)
    build_tree_triton(ws.lp, ws.ids, root, start, tokens, parents, depth, positions, mask, ws, scores)
    return ws
