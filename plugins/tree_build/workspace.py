"""Scratch of the tree_build kernels, sized from static shapes only, carved from one byte buffer.

b requests, D depths, V vocab, B budget, K = min(topk, V, B) candidates per depth (a rank >= B never
enters a tree of B nodes, so the kernels keep at most B), rows = b * D.  The caller allocates the
buffer once for a capacity, TreeBuildWorkspace.allocate(b, D, V, B, topk, device), and passes its
.buffer to every kdtree::tree_build call whose b, D, V, B and topk are each at most the capacity's
(the bytes needed grow with each of them); each call carves its own views (plugins/common/workspace.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plugins.common.workspace import Spec, carve, workspace_bytes

MAX_BUDGET = 1024  # 10-bit ranks and lexicographic ranks in the packed keys
MAX_DEPTH = 16


def _pow2(n: int) -> int:
    """The smallest power of two >= n >= 1 (as triton.next_power_of_2; this module runs without Triton)."""
    return 1 << (n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def candidate_count(budget: int, k: int) -> int:
    """|{(i, r): i < B, r < K, (i + 1)(r + 1) <= B}|: the children examined per depth."""
    return sum(min(k, budget // (i + 1)) for i in range(budget))


def default_chunk(v: int) -> int:
    """Logits per CTA in stage 1: 4096 for a real vocabulary, smaller for tiny test vocabularies."""
    return min(4096, max(16, _pow2(v) // 2))


@dataclass
class TreeBuildWorkspace:
    """The scratch views of one tree_build call and the buffer they are carved from (allocate once for a
    capacity; pass .buffer to kdtree::tree_build, which carves its call's views with carve)."""
    b: int
    depth: int
    vocab: int
    budget: int
    k: int
    chunk: int
    p_pad: int                # next pow2 >= max(B, candidate_count(B, K))
    buffer: torch.Tensor      # [nbytes] uint8: every view below, 256-byte aligned
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
        return _cdiv(self.vocab, self.chunk)

    @property
    def b_pad(self) -> int:
        return max(2, _pow2(self.budget))

    @property
    def d_pad(self) -> int:
        return _pow2(self.depth)

    @classmethod
    def allocate(cls, b: int, depth: int, vocab: int, budget: int, topk: int, device,
                 chunk: int | None = None) -> "TreeBuildWorkspace":
        """A fresh buffer for calls up to this capacity, carved for exactly these shapes."""
        buffer = torch.empty(cls.nbytes(b, depth, vocab, budget, topk, chunk), dtype=torch.uint8, device=device)
        return cls.carve(buffer, b, depth, vocab, budget, topk, chunk)

    @classmethod
    def nbytes(cls, b: int, depth: int, vocab: int, budget: int, topk: int, chunk: int | None = None) -> int:
        return workspace_bytes(_specs(*_dims(depth, vocab, budget, topk, chunk), b, depth, vocab))

    @classmethod
    def carve(cls, buffer: torch.Tensor, b: int, depth: int, vocab: int, budget: int, topk: int,
              chunk: int | None = None) -> "TreeBuildWorkspace":
        """The views one call with these shapes uses, from the start of buffer [nbytes] uint8 (ValueError
        when the buffer is smaller than nbytes(...) of this call)."""
        k, chunk, p_pad, b_pad, d_pad = _dims(depth, vocab, budget, topk, chunk)
        call = f"b {b}, D {depth}, V {vocab}, B {budget}, topk {topk}"
        views = carve(buffer, _specs(k, chunk, p_pad, b_pad, d_pad, b, depth, vocab), "tree_build", call)
        return cls(b, depth, vocab, budget, k, chunk, p_pad, buffer, *views)


def _dims(depth: int, vocab: int, budget: int, topk: int, chunk: int | None) -> tuple[int, int, int, int, int]:
    """(K, chunk, P_PAD, B_PAD, D_PAD) after the kernel's limits are checked."""
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
    b_pad, d_pad = max(2, _pow2(budget)), _pow2(depth)  # tl.sort needs >= 2
    p_pad = max(b_pad, _pow2(candidate_count(budget, k)))
    return k, chunk, p_pad, b_pad, d_pad


def _specs(k: int, chunk: int, p_pad: int, b_pad: int, d_pad: int, b: int, depth: int, vocab: int) -> list[Spec]:
    """(shape, dtype) of the views, in TreeBuildWorkspace's field order."""
    rows, c = b * depth, _cdiv(vocab, chunk)
    f64, f32, i32 = torch.float64, torch.float32, torch.int32
    return [((rows, c), f64), ((rows, c), f64), ((rows, 4, 256), i32), ((rows, c, 256), i32), ((rows,), i32),
            ((rows, k), f32), ((rows, k), i32), ((rows, k), f32), ((rows, k), i32),
            ((b, d_pad, b_pad), f32), ((b, 7, d_pad, b_pad), i32), ((b, p_pad + b_pad + d_pad), i32)]
