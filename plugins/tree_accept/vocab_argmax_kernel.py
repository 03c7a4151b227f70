"""Triton kernels of the vocab-parallel argmax (see vocab_argmax.py): the local pass (one program per row, a
running per-lane (value, column) over the slice in BLOCK_V chunks: the posterior kernel's argmax steps) and the
pick across ranks (one program per request, its rows as lanes, the ranks in a loop)."""

from __future__ import annotations

import triton
import triton.language as tl

from plugins.common.pdl import pdl_prologue
from plugins.tree_accept.posterior_kernel import argmax_final, argmax_step


@triton.jit
def vocab_argmax_local_kernel(x_ptr, pair_ptr, valid, start, s_row, BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, BLOCK_V).to(tl.int64)
    best = tl.full((BLOCK_V,), float("-inf"), dtype=tl.float64)  # per-lane running max (fp64: exact for fp32 / fp64)
    best_i = lane  # and the lowest column reaching it
    nan = tl.zeros((BLOCK_V,), dtype=tl.int1)
    col0 = row * 0  # int64; a while loop (a runtime trip count) also runs in the interpreter
    while col0 < valid:
        cols = col0 + lane
        x = tl.load(x_ptr + row * s_row + cols, mask=cols < valid, other=float("-inf")).to(tl.float64)
        nan = nan | (x != x)
        best, best_i = argmax_step(x, cols, best, best_i)
        col0 += BLOCK_V
    top, pick = argmax_final(best, best_i, valid)
    top = tl.where(tl.max(nan.to(tl.int32), axis=0) != 0, float("nan"), top)  # torch's max propagates NaN
    tl.store(pair_ptr + 2 * row, top)
    tl.store(pair_ptr + 2 * row + 1, (pick + start).to(tl.float64))


@triton.jit
def vocab_argmax_pick_kernel(every_ptr, ids_ptr, flag_ptr, world, rows, rows_per_req, BLOCK_R: tl.constexpr,
                             PDL: tl.constexpr):
    pdl_prologue(PDL)
    req = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, BLOCK_R)
    row = req * rows_per_req + lane  # [BLOCK_R] this request's rows
    ok = lane < rows_per_req
    best = tl.full((BLOCK_R,), float("-inf"), dtype=tl.float64)
    ids = tl.zeros((BLOCK_R,), dtype=tl.float64)
    nan = tl.zeros((BLOCK_R,), dtype=tl.int1)
    w = req * 0
    while w < world:  # the lowest rank wins a tie (torch.argmax over the gathered pairs)
        v = tl.load(every_ptr + 2 * (w * rows + row), mask=ok, other=0.0)
        i = tl.load(every_ptr + 2 * (w * rows + row) + 1, mask=ok, other=0.0)
        better = (v > best) | (w == 0)
        nan = nan | (v != v)
        ids = tl.where(better, i, ids)
        best = tl.where(better, v, best)
        w += 1
    tl.store(ids_ptr + row, ids.to(tl.int64), mask=ok)
    # the request's flag: some row's best logit is NaN (torch's argmax takes a NaN as the maximum) or +-Inf
    bad = ok & (nan | (best == float("inf")) | (best == float("-inf")))
    tl.store(flag_ptr + req, tl.max(bad.to(tl.int32), axis=0).to(tl.int64))
