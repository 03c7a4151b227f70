"""Triton kernel for round_emit (reference.py holds the semantics): one program per request, one launch for
what was ~30 torch kernels (the accepted path's gather and shift, compares, cumsum, reductions, five column
copies) at the end of every round."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plugins.common.pdl import pdl_args, pdl_for, pdl_prologue


@triton.jit
def _round_emit_kernel(cand_ptr, count_ptr, stop_ptr, produced_ptr, max_new_ptr, live_ptr, nonfinite_ptr, out_ptr,
                       bonus_ptr, tok_ptr, idx_ptr, ctx_ptr, lens_ptr, A, S, s_c, s_s, s_o, s_t, s_i, s_x,
                       AR: tl.constexpr, TREE: tl.constexpr, LENS: tl.constexpr, BLOCK_A: tl.constexpr,
                       BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    r = tl.program_id(0).to(tl.int64)
    slot = tl.arange(0, BLOCK_A)
    am = slot < A
    live = tl.load(live_ptr + r)  # int32
    if TREE:  # count := count * live; path = tokens[path_idx]; ctx := path; cand = path after each slot, bonus last
        count = tl.load(count_ptr + r) * live
        tl.store(count_ptr + r, count)
        idx = tl.load(idx_ptr + r * s_i + slot, mask=am, other=0).to(tl.int64)  # [BLOCK_A]
        path = tl.load(tok_ptr + r * s_t + idx, mask=am, other=0)  # [BLOCK_A] int64
        tl.store(ctx_ptr + r * s_x + slot, path, mask=am)
        nxt = tl.load(idx_ptr + r * s_i + (slot + 1) % A, mask=am, other=0).to(tl.int64)  # the next slot's node
        after = tl.load(tok_ptr + r * s_t + nxt, mask=am, other=0)  # [BLOCK_A] path rolled by one
        cand = tl.where(slot == count - 1, tl.load(bonus_ptr + r), after)
    else:
        cand = tl.load(cand_ptr + r * s_c + slot, mask=am, other=0)  # [BLOCK_A] int64
    if AR:  # count := live, bonus := cand[0] where live
        count = live
        tl.store(count_ptr + r, count)
        first_tok = tl.sum(tl.where(slot == 0, cand, 0), axis=0)
        bonus = tl.load(bonus_ptr + r)
        tl.store(bonus_ptr + r, tl.where(live != 0, first_tok, bonus))
        if LENS:  # the committed row's advance (the step's kv_commit ran with advance=False)
            tl.store(lens_ptr + r, tl.load(lens_ptr + r) + count)
    elif not TREE:
        count = tl.load(count_ptr + r)
    js = tl.arange(0, BLOCK_S)
    sm = js < S
    stops = tl.load(stop_ptr + r * s_s + js, mask=sm, other=-1)  # [BLOCK_S] int64
    hit = tl.max(((cand[:, None] == stops[None, :]) & sm[None, :]).to(tl.int32), axis=1) != 0  # [BLOCK_A]
    produced = tl.load(produced_ptr + r)
    max_new = tl.load(max_new_ptr + r)
    valid = am & (slot < count)
    fin = valid & (hit | ((produced + slot + 1) >= max_new))  # [BLOCK_A]
    first = tl.min(tl.where(fin, slot, BLOCK_A), axis=0)  # the first finishing slot (BLOCK_A: none)
    n = tl.sum((valid & (slot <= first)).to(tl.int32), axis=0)
    live_new = tl.where(first < BLOCK_A, 0, live)
    tl.store(produced_ptr + r, produced + n)
    tl.store(live_ptr + r, live_new)
    row = out_ptr + r * s_o
    tl.store(row + slot, cand, mask=am)
    tl.store(row + A, n.to(tl.int64))
    tl.store(row + A + 1, live_new.to(tl.int64))
    tl.store(row + A + 2, count.to(tl.int64))
    tl.store(row + A + 3, tl.load(nonfinite_ptr + r))
    tl.store(nonfinite_ptr + r, tl.zeros((), tl.int64))  # read: the next pick sets it afresh


def round_emit_triton(cand: torch.Tensor | None, count: torch.Tensor, stop_ids: torch.Tensor, produced: torch.Tensor,
                      max_new: torch.Tensor, live: torch.Tensor, nonfinite: torch.Tensor, out: torch.Tensor,
                      bonus: torch.Tensor | None, tokens: torch.Tensor | None = None,
                      path_idx: torch.Tensor | None = None, ctx_tokens: torch.Tensor | None = None,
                      cache_lens: torch.Tensor | None = None) -> None:
    """reference.round_emit_reference's writes in one launch (CUDA tensors; CPU ones under TRITON_INTERPRET=1)."""
    tree = tokens is not None
    b, a = path_idx.shape if tree else cand.shape
    if b == 0:
        return
    s = stop_ids.shape[1]
    cand = path_idx if tree else cand  # an unread pointer in a tree round
    tok, idx, ctx = (tokens, path_idx, ctx_tokens) if tree else (cand, cand, cand)
    _round_emit_kernel[(b,)](cand, count, stop_ids, produced, max_new, live, nonfinite, out,
                             bonus if bonus is not None else cand, tok, idx, ctx,
                             cache_lens if cache_lens is not None else count, a, s, cand.stride(0),
                             stop_ids.stride(0), out.stride(0), tok.stride(0), idx.stride(0), ctx.stride(0),
                             AR=bonus is not None and not tree, TREE=tree, LENS=cache_lens is not None,
                             BLOCK_A=max(2, triton.next_power_of_2(a)),
                             BLOCK_S=max(2, triton.next_power_of_2(s)), num_warps=1,
                             **pdl_args(pdl_for(count)))
