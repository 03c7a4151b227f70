"""Stage 1 of tree_build on the GPU: drafter logits [rows, V] -> the K best log-probs per row.

Exactly reference.topk_logprobs_reference (lse accumulated in fp64 and rounded to fp32,
lp = fp32(logit - lse), ordered by lp descending then token id ascending), as six launches over
rows x C chunks of CH logits and one over rows:
  1. _lse_partial   per chunk fp64 max and sum of exp(x - max); zeroes the row's histograms.
  2-5. _radix_pass  radix select of the K-th largest lp key (32-bit order-preserving, four 8-bit
                    digits: Triton 3.6 lowers tl.histogram to per-thread ballots over bins / 32 bins
                    per element, so wide digits cost more than an extra pass): every chunk recomputes
                    lse from the partials and lp for its logits, and adds the histogram of the next
                    digit of the keys that match the prefix chosen so far; the last pass also keeps
                    per-chunk histograms.
  6. _gather        keys above the threshold t go anywhere in [0, K - e) (atomic counter); of the keys
                    equal to t the e with the smallest token ids (per-chunk counts give each chunk its
                    offset) go to [K - e, K).
  7. _sort_rows     one CTA per row sorts its K candidates by (lp desc, id asc).
"""

from __future__ import annotations

import triton
import triton.language as tl

from plugins.common.keys import ordered, unordered
from plugins.common.pdl import pdl_args, pdl_for, pdl_prologue

PASSES = 4  # 8-bit radix digits, most significant first
HIST_BINS = 256


@triton.jit
def _lse_partial_kernel(logits_ptr, m_ptr, s_ptr, hist_ptr, cnt_ptr, V, C,
                        CH: tl.constexpr, HIST_BINS: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0)
    c = tl.program_id(1)
    offs = c * CH + tl.arange(0, CH)
    x = tl.load(logits_ptr + row.to(tl.int64) * V + offs, mask=offs < V, other=float("-inf"))
    x = x.to(tl.float32).to(tl.float64)  # [CH]
    m = tl.max(x, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(tl.exp(x - m_safe), 0)
    tl.store(m_ptr + row * C + c, m)
    tl.store(s_ptr + row * C + c, s)
    if c == 0:  # later launches accumulate into these
        bins = tl.arange(0, HIST_BINS)
        for p in tl.static_range(4):
            tl.store(hist_ptr + (row * 4 + p) * HIST_BINS + bins, tl.zeros([HIST_BINS], tl.int32))
        tl.store(cnt_ptr + row, 0)


@triton.jit
def _row_lse(m_ptr, s_ptr, row, C, C_PAD: tl.constexpr):
    """fp32(log(sum_c s_c exp(m_c - M)) + M), M = max_c m_c: the row's fp64 lse rounded once."""
    c = tl.arange(0, C_PAD)
    m = tl.load(m_ptr + row * C + c, mask=c < C, other=float("-inf"))  # [C_PAD] fp64
    s = tl.load(s_ptr + row * C + c, mask=c < C, other=0.0)
    mm = tl.max(m, 0)
    tot = tl.sum(tl.where(c < C, s * tl.exp(m - mm), 0.0), 0)
    return (mm + tl.log(tot)).to(tl.float32)


@triton.jit
def _chunk_keys(logits_ptr, lse, row, c, V, CH: tl.constexpr):
    """-> (lp fp32 [CH], key int64 [CH] in [0, 2^32) ordered like lp, valid [CH], token ids [CH])."""
    offs = c * CH + tl.arange(0, CH)
    valid = offs < V
    x = tl.load(logits_ptr + row.to(tl.int64) * V + offs, mask=valid, other=0.0).to(tl.float32)
    lp = x - lse
    key = ordered(lp).to(tl.int64) + 2147483648
    return lp, key, valid, offs


@triton.jit
def _resolve(hist_ptr, row, k, NPASS: tl.constexpr, HIST_BINS: tl.constexpr):
    """Digits of the k-th largest key fixed by the first NPASS passes -> (prefix, rank left within it)."""
    prefix = tl.zeros([], tl.int64)
    k_rem = tl.zeros([], tl.int32) + k
    bins = tl.arange(0, HIST_BINS)
    for p in tl.static_range(NPASS):
        h = tl.load(hist_ptr + (row * 4 + p) * HIST_BINS + bins)  # [HIST_BINS]
        at_least = tl.cumsum(h, 0, reverse=True)  # keys with this digit or a larger one
        digit = tl.sum((at_least >= k_rem).to(tl.int32), 0) - 1
        k_rem = k_rem - tl.sum(tl.where(bins > digit, h, 0), 0)
        prefix = prefix * HIST_BINS + digit
    return prefix, k_rem


@triton.jit
def _radix_pass_kernel(logits_ptr, m_ptr, s_ptr, hist_ptr, chunk_hist_ptr, V, C, K,
                       PASS: tl.constexpr, CH: tl.constexpr, C_PAD: tl.constexpr, HIST_BINS: tl.constexpr,
                       PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0)
    c = tl.program_id(1)
    lse = _row_lse(m_ptr, s_ptr, row, C, C_PAD)
    lp, key, valid, offs = _chunk_keys(logits_ptr, lse, row, c, V, CH)
    prefix, k_rem = _resolve(hist_ptr, row, K, PASS, HIST_BINS)
    shift: tl.constexpr = 24 - 8 * PASS
    match = valid & ((key >> (shift + 8)) == prefix)
    digit = ((key >> shift) & (HIST_BINS - 1)).to(tl.int32)
    h = tl.histogram(digit, HIST_BINS, mask=match)  # [HIST_BINS]
    bins = tl.arange(0, HIST_BINS)
    tl.atomic_add(hist_ptr + (row * 4 + PASS) * HIST_BINS + bins, h, mask=h > 0)
    if PASS == 3:  # per-chunk counts of each final digit: the offsets of the tied keys
        tl.store(chunk_hist_ptr + (row * C + c) * HIST_BINS + bins, h)


@triton.jit
def _gather_kernel(logits_ptr, m_ptr, s_ptr, hist_ptr, chunk_hist_ptr, cnt_ptr, cand_lp_ptr, cand_id_ptr,
                   V, C, K, CH: tl.constexpr, C_PAD: tl.constexpr, HIST_BINS: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0)
    c = tl.program_id(1)
    lse = _row_lse(m_ptr, s_ptr, row, C, C_PAD)
    lp, key, valid, offs = _chunk_keys(logits_ptr, lse, row, c, V, CH)
    t, n_eq = _resolve(hist_ptr, row, K, 4, HIST_BINS)  # the K-th key; n_eq keys equal to it are taken
    n_gt = K - n_eq
    cc = tl.arange(0, C_PAD)
    before = tl.load(chunk_hist_ptr + (row * C + cc) * HIST_BINS + (t & (HIST_BINS - 1)), mask=cc < c, other=0)
    eq_base = tl.sum(before, 0)  # keys equal to t in earlier chunks (smaller token ids)
    is_gt = valid & (key > t)
    is_eq = valid & (key == t)
    eq_rank = eq_base + tl.cumsum(is_eq.to(tl.int32), 0) - 1
    take_eq = is_eq & (eq_rank < n_eq)
    gt_base = tl.atomic_add(cnt_ptr + row, tl.sum(is_gt.to(tl.int32), 0))
    dst = tl.where(is_gt, gt_base + tl.cumsum(is_gt.to(tl.int32), 0) - 1, n_gt + eq_rank)
    keep = is_gt | take_eq
    tl.store(cand_lp_ptr + row * K + dst, lp, mask=keep)
    tl.store(cand_id_ptr + row * K + dst, offs, mask=keep)


@triton.jit
def _sort_rows_kernel(cand_lp_ptr, cand_id_ptr, lp_ptr, ids_ptr, K, K_PAD: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0)
    r = tl.arange(0, K_PAD)
    valid = r < K
    lp = tl.load(cand_lp_ptr + row * K + r, mask=valid, other=0.0)
    tok = tl.load(cand_id_ptr + row * K + r, mask=valid, other=0)
    key = (ordered(lp).to(tl.int64) << 31) | (0x7FFFFFFF - tok.to(tl.int64))
    key = tl.where(valid, key, -9223372036854775807 - 1)
    key = tl.sort(key, descending=True)
    tl.store(lp_ptr + row * K + r, unordered((key >> 31).to(tl.int32)), mask=valid)
    tl.store(ids_ptr + row * K + r, (0x7FFFFFFF - (key & 0x7FFFFFFF)).to(tl.int32), mask=valid)


def topk_logprobs_triton(logits, k: int, ws) -> None:
    """logits [rows, V] (contiguous, fp32/bf16/fp16) -> ws.lp [rows, k] fp32, ws.ids [rows, k] int32."""
    rows, v = logits.shape
    ch, c = ws.chunk, ws.chunks
    c_pad = triton.next_power_of_2(c)
    warps = 8 if ch >= 2048 else 4
    grid = (rows, c)
    pdl = pdl_args(pdl_for(logits))
    _lse_partial_kernel[grid](logits, ws.m, ws.s, ws.hist, ws.cnt, v, c, CH=ch, HIST_BINS=HIST_BINS,
                              **pdl, num_warps=warps)
    for p in range(PASSES):
        _radix_pass_kernel[grid](logits, ws.m, ws.s, ws.hist, ws.chunk_hist, v, c, k, PASS=p, CH=ch, C_PAD=c_pad,
                                 HIST_BINS=HIST_BINS, **pdl, num_warps=warps)
    _gather_kernel[grid](logits, ws.m, ws.s, ws.hist, ws.chunk_hist, ws.cnt, ws.cand_lp, ws.cand_id, v, c, k,
                         CH=ch, C_PAD=c_pad, HIST_BINS=HIST_BINS, **pdl, num_warps=warps)
    k_pad = max(2, triton.next_power_of_2(k))
    _sort_rows_kernel[(rows,)](ws.cand_lp, ws.cand_id, ws.lp, ws.ids, k, K_PAD=k_pad,
                               **pdl, num_warps=4 if k_pad <= 256 else 8)
