"""Reference for tree_accept: walk the verified tree along the target's own choices.

Shapes: b requests, N tree nodes (root first), a = D + 1 accept capacity.

    posterior  [b, N] int64  the target's token after each node (argmax at T = 0, a sample of
                             softmax(logits / T) at T > 0, drawn independently per node)
    tokens     [b, N] int64  node tokens (tokens[:, 0] = root = last round's bonus)
    parents    [b, N] int32  parent index, -1 for the root
 -> accept_idx [b, a] int32  path node indices, root first; slots >= accept_len are left as they were
    accept_len [b] int32     path length (root included), 1..D+1
    bonus      [b] int64     the target's token after the last path node (the next root)

cur = root; while some child c of cur has tokens[c] == posterior[cur]: cur = c.  Each emitted
token is the target's own choice given the accepted prefix, so the output is distributed exactly
as the target's (lossless at any temperature); sibling tokens are distinct, so the child is unique.
"""

from __future__ import annotations

import torch


def tree_accept_reference(posterior: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                          accept_idx: torch.Tensor, accept_len: torch.Tensor, bonus: torch.Tensor) -> None:
    b, n = tokens.shape
    post, tok, par = posterior.tolist(), tokens.tolist(), parents.tolist()
    for r in range(b):
        children: dict[int, dict[int, int]] = {}
        for j in range(1, n):
            children.setdefault(par[r][j], {}).setdefault(tok[r][j], j)
        path = [0]
        while True:
            nxt = children.get(path[-1], {}).get(post[r][path[-1]])
            if nxt is None:
                break
            path.append(nxt)
        if len(path) > accept_idx.shape[1]:
            raise ValueError(f"tree_accept: path of {len(path)} nodes exceeds accept capacity {accept_idx.shape[1]}")
        accept_idx[r, : len(path)] = torch.tensor(path, dtype=torch.int32)
        accept_len[r] = len(path)
        bonus[r] = post[r][path[-1]]
