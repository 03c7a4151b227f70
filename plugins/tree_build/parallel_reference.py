"""The parallel tree-selection algorithm of the GPU kernel, written in torch (CPU oracle for its logic).

Input lp [D, K] fp32 (per depth sorted descending, ties by token id), budget B.  Output: for nodes
1..B in key order (-score, depth, rank tuple), the depth, the rank at that depth and the parent node.
It is the same function as reference._best_first; NOTES.md proves it.  Per depth d it keeps A_d, the
best min(B, |children of A_{d-1}|) depth-d prefixes among the children of A_{d-1}, in key order:

  1. candidates P = {(i, r): (i + 1) (r + 1) <= B} (i = position of the parent in A_{d-1}, r = rank);
  2. S = the M-th largest child score in P (M = |A_d|): every child outside P has >= B children in
     P scoring at least as much, so S is the M-th largest over all children and every child scoring
     more than S is in P;
  3. the G children scoring > S are the first G of P sorted by the key; the remaining m = M - G are
     the children scoring exactly S with the smallest rank tuples, i.e. in order (lexrank(parent), r):
     for parent j they are the ranks [lo_j, hi_j) (binary search on the fp32 sums), taken greedily
     with parents in lexicographic order;
  4. lexrank of each element of A_d = rank of (lexrank(parent), r) within A_d.
The tree is then the B best of the union of the A_d by (-score, depth, lexrank).
"""

from __future__ import annotations

import numpy as np
import torch


def ordered_key(score: torch.Tensor) -> torch.Tensor:
    """fp32 -> int64 whose signed order is the float order (+0.0 and -0.0 made equal)."""
    bits = (score + 0.0).view(torch.int32).long()  # [...]
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _fsum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.float() + b.float()).float()


def candidate_pairs(n: int, k: int, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(i, r) with i < n, r < k and (i + 1) (r + 1) <= budget, i-major."""
    i = torch.arange(n)
    lens = torch.clamp(torch.minimum(torch.full_like(i, k), budget // (i + 1)), min=0)  # [n]
    pi = torch.repeat_interleave(i, lens)
    start = torch.cumsum(lens, 0) - lens
    pr = torch.arange(int(lens.sum())) - torch.repeat_interleave(start, lens)
    return pi, pr


def best_prefixes_parallel(lp: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """lp [D, K] fp32 -> (depth [B], rank [B], parent [B]) of nodes 1..B (parent 0 = root)."""
    depth_max, k = lp.shape
    k = min(k, budget)
    lp = lp[:, :k].float()
    # per depth: score, lexrank, parent position, rank; all in key order within the depth
    m1 = min(budget, k)
    levels = [dict(score=lp[0, :m1].clone() + 0.0, lex=torch.arange(m1), par=torch.full((m1,), -1),
                   rank=torch.arange(m1))]
    for d in range(1, depth_max):
        prev = levels[-1]
        n = prev["score"].numel()
        m_d = min(budget, n * k)
        pi, pr = candidate_pairs(n, k, budget)
        sc = _fsum(prev["score"][pi], lp[d, pr])  # [|P|]
        # sort P by the key (-score, lexrank(parent), r)
        order = torch.from_numpy(np.lexsort((pr.numpy(), prev["lex"][pi].numpy(), -sc.double().numpy())))
        s_star = sc[order[m_d - 1]]
        g = int((sc > s_star).sum())
        gt = order[:g]
        # ties at s_star over all children: ranks [lo_j, hi_j) of parent j
        sums = _fsum(prev["score"][:, None], lp[d][None, :])  # [n, k] (the kernel binary-searches instead)
        lo = (sums > s_star).sum(1)
        hi = (sums >= s_star).sum(1)
        by_lex = torch.argsort(prev["lex"])  # parent positions in lexicographic order
        take_len = (hi - lo)[by_lex]
        before = torch.cumsum(take_len, 0) - take_len
        take = torch.clamp(torch.minimum(take_len, (m_d - g) - before), min=0)
        tie_par = torch.repeat_interleave(by_lex, take)
        tie_rank = lo[tie_par] + torch.arange(int(take.sum())) - torch.repeat_interleave(before, take)
        par = torch.cat([pi[gt], tie_par])
        rank = torch.cat([pr[gt], tie_rank])
        score = torch.cat([sc[gt], torch.full((tie_par.numel(),), float(s_star))]).float()
        assert par.numel() == m_d
        lexkey = prev["lex"][par] * k + rank
        lex = torch.empty(m_d, dtype=torch.long)
        lex[torch.argsort(lexkey)] = torch.arange(m_d)
        levels.append(dict(score=score, lex=lex, par=par, rank=rank))
    # the union, by (-score, depth, lexrank)
    keys = sorted((-s, d, lex, pos) for d, lv in enumerate(levels)
                  for pos, (s, lex) in enumerate(zip(lv["score"].tolist(), lv["lex"].tolist())))
    keys = keys[:budget]
    node_of = {(d, pos): q + 1 for q, (_, d, _, pos) in enumerate(keys)}
    depth = torch.tensor([d + 1 for _, d, _, _ in keys])
    rank = torch.tensor([int(levels[d]["rank"][pos]) for _, d, _, pos in keys])
    parent = torch.tensor([0 if d == 0 else node_of[(d - 1, int(levels[d]["par"][pos]))] for _, d, _, pos in keys])
    return depth, rank, parent
