"""Preallocated buffers of the tree_build kernels, sized from static shapes only.

b requests, D depths, V vocab, B budget, K = min(topk, V, B) candidates per depth (a rank >= B never
enters a tree of B nodes, so the kernels keep at most B), rows = b * D.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

MAX_BUDGET = 1024  # 10-bit ranks and lexicographic ranks in the packed keys
MAX_DEPTH = 16


def candidate_count(budget: int, k: int) -> int:
    """|{(i, r): i < B, r < K, (i + 1)(r + 1) <= B}|: the children examined per depth."""
    return sum(min(k, budget // (i + 1)) for i in range(budget))


def default_chunk(v: int) -> int:
    """Logits per CTA in stage 1: 4096 for a real vocabulary, smaller for tiny test vocabularies."""
    return min(4096, max(16, triton.next_power_of_2(v) // 2))


@dataclass
class TreeBuildWorkspace:
    b: int
    depth: int
    vocab: int
    budget: int
    k: int
    chunk: int
    p_pad: int                # next pow2 >= max(B, candidate_count(B, K))
    m: torch.Tensor           # [rows, C] fp64 chunk max
    s: torch.Tensor           # [rows, C] fp64 chunk sum of exp(x - max)
    hist: torch.Tensor        # [rows, 4, 256] int32 radix histograms
    chunk_hist: torch.Tensor  # [rows, C, 256] int32 last-digit histogram per chunk
    cnt: torch.Tensor         # [rows] int32 keys above the threshold placed so far
    cand_lp: torch.Tensor     # [rows, K] fp32 selected, unordered
    cand_id: torch.Tensor     # [rows, K] int32
    lp: torch.Tensor          # [rows, K] fp32 sorted (lp desc, id asc)
    ids: torch.Tensor         # [rows, K] int32
    score: torch.Tensor       # [b, D_PAD, B_PAD] fp32 per-depth kept prefixes A_d
    ints: torch.Tensor        # [b, 7, D_PAD, B_PAD] int32 lex, par, rank, poslex, plex, node_of, ancestors
    table: torch.Tensor       # [b, P_PAD + B_PAD + D_PAD] int32 candidate table, tie marks, |A_d|

    @property
    def chunks(self) -> int:
        return triton.cdiv(self.vocab, self.chunk)

    @property
    def b_pad(self) -> int:
        return max(2, triton.next_power_of_2(self.budget))

    @property
    def d_pad(self) -> int:
        return triton.next_power_of_2(self.depth)

    @classmethod
    def allocate(cls, b: int, depth: int, vocab: int, budget: int, topk: int, device,
                 chunk: int | None = None) -> "TreeBuildWorkspace":
        if not 1 <= budget <= MAX_BUDGET:
            raise ValueError(f"tree_build kernel: budget must be in [1, {MAX_BUDGET}], got {budget}")
        if not 1 <= depth <= MAX_DEPTH:
            raise ValueError(f"tree_build kernel: depth must be in [1, {MAX_DEPTH}], got {depth}")
        if topk < 1:
            raise ValueError(f"tree_build kernel: topk must be >= 1, got {topk}")
        k = min(topk, vocab, budget)
        chunk = chunk or default_chunk(vocab)
        if chunk & (chunk - 1):
            raise ValueError(f"tree_build kernel: chunk must be a power of two, got {chunk}")
        rows, c = b * depth, triton.cdiv(vocab, chunk)
        b_pad, d_pad = max(2, triton.next_power_of_2(budget)), triton.next_power_of_2(depth)  # tl.sort needs >= 2
        p_pad = max(b_pad, triton.next_power_of_2(candidate_count(budget, k)))
        i32 = dict(dtype=torch.int32, device=device)
        return cls(b, depth, vocab, budget, k, chunk, p_pad,
                   m=torch.empty(rows, c, dtype=torch.float64, device=device),
                   s=torch.empty(rows, c, dtype=torch.float64, device=device),
                   hist=torch.empty(rows, 4, 256, **i32), chunk_hist=torch.empty(rows, c, 256, **i32),
                   cnt=torch.empty(rows, **i32),
                   cand_lp=torch.empty(rows, k, dtype=torch.float32, device=device), cand_id=torch.empty(rows, k, **i32),
                   lp=torch.empty(rows, k, dtype=torch.float32, device=device), ids=torch.empty(rows, k, **i32),
                   score=torch.empty(b, d_pad, b_pad, dtype=torch.float32, device=device),
                   ints=torch.empty(b, 7, d_pad, b_pad, **i32),
                   table=torch.empty(b, p_pad + b_pad + d_pad, **i32))

    def fits(self, b: int, depth: int, vocab: int, budget: int, topk: int) -> bool:
        return (b, depth, vocab, budget, min(topk, vocab, budget)) == (self.b, self.depth, self.vocab, self.budget,
                                                                      self.k)
