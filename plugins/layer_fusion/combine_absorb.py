"""The attention's split combine folded into the v absorption: one kernel instead of tree_verify_mla's combine
kernel followed by mla_v_absorb (one kernel boundary fewer per MLA layer: ~1.5-3 us of a decode step's critical path).

Letters: b requests, n tokens per request, t = b * n tokens, h heads, c latent (d_v of tree_verify_mla), u value
dims, s splits of the key range, m = n * h partial rows per request (row = node * h + head).

    o_part [b, s, m, c] fp32  each split's normalised output (kdtree::tree_verify_mla_partials)
    l_part [b, s, m] fp32     its base-2 lse, -inf where the split saw no key (its o_part row is then not read)
    w_uv   [h, u, c]          W_UV
    out    [t, h, u]          sum_s 2^(l_s - max) o_s / sum_s 2^(l_s - max), rounded to out's dtype, . W_UV[h]^T

Program (token block, head, u block): for each of its tokens (at most `tok`) it merges the row of this head over
the splits, one [S_PAD, BLOCK_K] latent slice at a time, and multiplies the slice into its [BT, BLOCK_U] fp32
accumulator.  Every program of a (token, head) merges the same partials again (u / BLOCK_U times), so the
partials read from L2 are t * h * s * c * 4 B * (u / BLOCK_U) against the combine's t * h * s * c * 4 B: the
launcher trades tokens per program against u per program (fold_blocks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plugins.common.pdl import pdl_args, pdl_for, pdl_prologue

TILE = 8192  # fp32 partials per load: [S_PAD, BLOCK_K], as the combine kernel's [S_PAD, BLOCK_DV]
ROWS = 16  # the product's rows (BT: tl.dot's M >= 16); a program's tok <= ROWS tokens take the first


@triton.jit(do_not_specialize=["T", "N", "H", "num_splits", "tok"])  # one binary per (S_PAD, BLOCK_U, dtype)
def _mla_combine_v_absorb_kernel(opart_ptr, lpart_ptr, w_ptr, out_ptr, T, N, H, U, num_splits, tok, s_wh, s_wu,
                                 s_yt, s_yh, C: tl.constexpr, S_PAD: tl.constexpr, IEEE: tl.constexpr,
                                 BT: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Program (token block, head, u block): tokens [pid0 * tok, + tok) (tok <= BT, the dot's rows) of head h.

    Same as tree_verify_mla's combine then mla_v_absorb: the split weights 2^(l_s - max) (0 for an empty split;
    a row that saw no key merges to 0), the weighted sum divided by the weights' sum in fp32 and rounded to out's
    dtype where the combine stores o_lat, the product with W_UV accumulated in fp32 and rounded once.  Not the
    same: the sum over splits reduces a [S_PAD, BLOCK_K] tile where the combine reduces [S_PAD, BLOCK_DV] (another
    addition tree), and the dot takes the latent in BLOCK_K slices where mla_v_absorb takes 128: a merged element
    may round one ulp apart, and the product differs by that and by its summation order.  No lse is written (the
    runtime never reads the attention's)."""
    pdl_prologue(PDL)  # the split kernel has finished: its partials are visible
    t0 = tl.program_id(0) * tok
    h = tl.program_id(1)
    ru = tl.program_id(2) * BLOCK_U + tl.arange(0, BLOCK_U)  # [BLOCK_U] value dims
    um = ru < U
    rows = tl.arange(0, BT)
    rs = tl.arange(0, S_PAD)
    rk = tl.arange(0, BLOCK_K)
    m_rows = N * H
    dt = out_ptr.dtype.element_ty
    w_rows = w_ptr + h.to(tl.int64) * s_wh + ru.to(tl.int64) * s_wu  # [BLOCK_U] pointers
    n_tok = tl.minimum(tok, T - t0)
    acc = tl.zeros([BT, BLOCK_U], dtype=tl.float32)
    for i in range(0, n_tok):
        t = t0 + i
        part = ((t // N).to(tl.int64) * num_splits + rs) * m_rows + (t % N) * H + h  # [S_PAD] partial rows
        lse2 = tl.load(lpart_ptr + part, mask=rs < num_splits, other=float("-inf"))  # [S_PAD] base 2
        mx = tl.max(lse2, 0)
        wgt = tl.exp2(lse2 - tl.where(mx == float("-inf"), 0.0, mx))  # [S_PAD], 0 for empty splits
        tot = tl.sum(wgt, 0)
        tot = tl.where(tot > 0.0, tot, 1.0)
        live = lse2 > float("-inf")
        for k0 in range(0, C, BLOCK_K):
            o = tl.load(opart_ptr + part[:, None] * C + k0 + rk[None, :], mask=live[:, None], other=0.0)
            lat = (tl.sum(o * wgt[:, None], 0) / tot).to(dt)  # [BLOCK_K]: the combine's stored o_lat slice
            lat = tl.where(rows[:, None] == i, lat[None, :], 0.0).to(dt)  # [BT, BLOCK_K]: token i's row only
            w = tl.load(w_rows[None, :] + k0 + rk[:, None], mask=um[None, :], other=0.0)  # [BLOCK_K, BLOCK_U]
            if IEEE:
                acc = tl.dot(lat, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(lat, w, acc)  # rows other than i add exact zeros
    y = out_ptr + (t0 + rows).to(tl.int64)[:, None] * s_yt + h * s_yh + ru[None, :]
    tl.store(y, acc.to(dt), mask=(rows < n_tok)[:, None] & um[None, :])


def fold_blocks(t: int, s: int, u: int, c: int, itemsize: int) -> tuple[int, int, int]:
    """(tok, block_u, block_k) of a launch: u in blocks of up to 64 (8 heads x 2 programs per token at K2.6);
    tokens per program such that a program's partials (tok * s * c * 4 B) about match its W_UV slice
    (block_u * c * itemsize B), at most ROWS and at least 1 (s 129 at an AR step's 4K cache: 1; a 512-token prefill
    chunk's 2 splits: 16); block_k: the latent slice of one [S_PAD, block_k] fp32 load of TILE elements."""
    block_u = max(16, min(64, triton.next_power_of_2(u)))
    tok = max(1, min(ROWS, triton.next_power_of_2(t), block_u * itemsize // (4 * s)))
    tok = 1 << (tok.bit_length() - 1)  # a power of two: fewer distinct grids
    block_k = min(c, 128, max(16, TILE // triton.next_power_of_2(s)))
    return tok, block_u, block_k


def mla_combine_v_absorb_triton(o_part: torch.Tensor, l_part: torch.Tensor, w_uv: torch.Tensor, out: torch.Tensor,
                                pdl: bool | None = None) -> None:
    """o_part [b, s, n*h, c], l_part [b, s, n*h] (contiguous fp32, s >= 1: tree_verify_mla_partials), w_uv
    [h, u, c] (unit stride along c) -> out [b*n, h, u] (unit stride along u, w_uv's dtype).
    pdl False: launched without programmatic dependent launch; else where plugins/common/pdl.pdl_for says."""
    b, s, m_rows, c = o_part.shape
    h, u = w_uv.shape[0], w_uv.shape[1]
    t = out.shape[0]
    if o_part.dtype != torch.float32 or l_part.dtype != torch.float32 or not o_part.is_contiguous() \
            or not l_part.is_contiguous() or l_part.shape != (b, s, m_rows) or s < 1:
        raise ValueError(f"mla_combine_v_absorb: o_part [b, s, m, c] and l_part [b, s, m] (s >= 1) must be "
                         f"contiguous fp32, got o_part {o_part.dtype} {tuple(o_part.shape)}, l_part {l_part.dtype} "
                         f"{tuple(l_part.shape)}")
    if w_uv.shape[2] != c or w_uv.stride(2) != 1 or m_rows % h or t != b * (m_rows // h) \
            or out.shape[1:] != (h, u) or out.stride(2) != 1 or out.dtype != w_uv.dtype or c < 16 or c & (c - 1):
        raise ValueError(f"mla_combine_v_absorb: need w_uv [h, u, {c}] (c a power of two >= 16), out [{b} * n, h, u] "
                         f"with m = n * h = {m_rows}, unit last strides and out's dtype w_uv's; got w_uv "
                         f"{w_uv.dtype} {tuple(w_uv.shape)} {w_uv.stride()}, out {out.dtype} {tuple(out.shape)} "
                         f"{out.stride()}")
    if t == 0 or h == 0:
        return
    tok, block_u, block_k = fold_blocks(t, s, u, c, w_uv.element_size())
    launch = pdl_args(pdl is not False and pdl_for(o_part))
    _mla_combine_v_absorb_kernel[(triton.cdiv(t, tok), h, triton.cdiv(u, block_u))](
        o_part, l_part, w_uv, out, t, m_rows // h, h, u, s, tok, w_uv.stride(0), w_uv.stride(1), out.stride(0),
        out.stride(1), C=c, S_PAD=triton.next_power_of_2(s), IEEE=w_uv.dtype == torch.float32, BT=ROWS,
        BLOCK_U=block_u, BLOCK_K=block_k, num_warps=4, **launch)

