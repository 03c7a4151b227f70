"""Stage 2 of tree_build on the GPU: sorted candidates -> the best-first tree, one CTA per request.

Computes the same function as reference.build_from_topk_reference by the level-parallel algorithm of
parallel_reference.py (NOTES.md proves it).  Per request, in the workspace (B_PAD = next pow2 >= B):
  score[d, q]   fp32  score of the q-th prefix of A_d (A_d in key order)
  ints[0] lex   lexicographic rank of that prefix's rank tuple within A_d
  ints[1] par   position of its parent in A_{d-1}
  ints[2] rank  its rank at depth d (index into the sorted candidates)
  ints[3] poslex  position in A_d of the prefix with lexicographic rank q
  ints[4] plex  lexicographic rank of its parent (input of the lexrank sort)
  ints[5] node  its tree node index (after the final selection)
  ints[6] anc   [level, node] ancestors found by the walk, for the mask
  table         [P_PAD] candidate -> parent position, [B_PAD] tie marks, [D_PAD] |A_d|
"""

from __future__ import annotations

import triton
import triton.language as tl

from plugins.common.keys import max_combine, ordered, pack, unordered, unpack
from plugins.common.pdl import pdl_args, pdl_for, pdl_prologue


@triton.jit
def _count_above(lp_row_ptr, s, s_star, K, valid, STRICT: tl.constexpr, LOGK: tl.constexpr):
    """Per lane: #{r < K : fp32(s + lp[r]) > s_star} (STRICT) or >= s_star; lp descending."""
    lo = tl.zeros(s.shape, tl.int32)
    hi = tl.zeros(s.shape, tl.int32) + K
    for _ in tl.static_range(LOGK):
        mid = (lo + hi) >> 1
        v = tl.load(lp_row_ptr + mid, mask=valid & (mid < K), other=float("-inf"))
        x = s + v
        if STRICT:
            pred = x > s_star
        else:
            pred = x >= s_star
        active = lo < hi
        lo = tl.where(active & pred, mid + 1, lo)
        hi = tl.where(active & (pred == 0), mid, hi)
    return lo


@triton.jit
def _tree_kernel(lp_ptr, ids_ptr, root_ptr, start_ptr,
                 tok_ptr, par_out_ptr, dep_out_ptr, pos_out_ptr, mask_ptr, sc_out_ptr,
                 score_ws, int_ws, tab_ws,
                 K, B, D, W,
                 B_PAD: tl.constexpr, P_PAD: tl.constexpr, D_PAD: tl.constexpr, W_MAX: tl.constexpr,
                 LOGK: tl.constexpr, HAS_SCORES: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    req = tl.program_id(0)
    N = B + 1
    lp_req = lp_ptr + req * D * K          # [D, K] this request's sorted log-probs
    ids_req = ids_ptr + req * D * K
    sc_ws = score_ws + req * D_PAD * B_PAD
    lex_ws = int_ws + (req * 7 + 0) * D_PAD * B_PAD
    par_ws = int_ws + (req * 7 + 1) * D_PAD * B_PAD
    rank_ws = int_ws + (req * 7 + 2) * D_PAD * B_PAD
    poslex_ws = int_ws + (req * 7 + 3) * D_PAD * B_PAD
    plex_ws = int_ws + (req * 7 + 4) * D_PAD * B_PAD
    node_ws = int_ws + (req * 7 + 5) * D_PAD * B_PAD
    anc_ws = int_ws + (req * 7 + 6) * D_PAD * B_PAD
    cand_ws = tab_ws + req * (P_PAD + B_PAD + D_PAD)
    tie_ws = cand_ws + P_PAD
    cnt_ws = tie_ws + B_PAD

    # the candidate table: flat f -> (pi, pr), rows i < B of length min(K, B // (i + 1))
    f = tl.arange(0, P_PAD)
    i_b = tl.arange(0, B_PAD)
    row_len = tl.where(i_b < B, tl.minimum(K, B // (i_b + 1)), 0)  # [B_PAD]
    row_end = tl.cumsum(row_len, 0)
    row_start = row_end - row_len
    n_cand = tl.sum(row_len, 0)
    tl.store(cand_ws + f, tl.zeros([P_PAD], tl.int32))
    tl.debug_barrier()
    tl.store(cand_ws + row_start, i_b, mask=i_b < B)
    tl.debug_barrier()
    pi = tl.associative_scan(tl.load(cand_ws + f), 0, max_combine)  # [P_PAD] parent position
    pr = f - tl.gather(row_start, pi, 0)                              # [P_PAD] child rank
    p_len = tl.gather(row_len, pi, 0)
    p_ok = f < n_cand
    saturable = p_ok & (p_len < K) & (pr == p_len - 1)  # last examined child of a row cut short

    # depth 1: A_1 = the first min(B, K) candidates, lexicographic rank = rank
    q = tl.arange(0, B_PAD)
    m_prev = tl.minimum(B, K)
    in1 = q < m_prev
    tl.store(sc_ws + q, tl.load(lp_req + q, mask=in1, other=0.0) + 0.0, mask=in1)
    tl.store(lex_ws + q, q, mask=in1)
    tl.store(par_ws + q, q * 0 - 1, mask=in1)
    tl.store(rank_ws + q, q, mask=in1)
    tl.store(poslex_ws + q, q, mask=in1)
    tl.store(cnt_ws, m_prev)
    tl.debug_barrier()

    for d in range(1, D_PAD):  # constexpr trip count (runtime bounds break the interpreter on numpy 2.4)
        if d < D:
            m_d = tl.minimum(B, m_prev * K)
            valid = p_ok & (pi < m_prev)
            off_prev = (d - 1) * B_PAD
            off = d * B_PAD
            p_score = tl.load(sc_ws + off_prev + pi, mask=valid, other=0.0)
            p_lex = tl.load(lex_ws + off_prev + pi, mask=valid, other=0)
            child = p_score + tl.load(lp_req + d * K + pr, mask=valid, other=0.0)  # [P_PAD] fp32 scores
            key = tl.where(valid, pack(child, (p_lex << 10) | pr), -9223372036854775807 - 1)
            top = tl.topk(key, B_PAD)  # [B_PAD] the best candidates, key order
            top_ord, top_tie = unpack(top)
            in_d = q < m_d
            star = tl.sum(tl.where(q == m_d - 1, top_ord, 0), 0)  # ordered score of the m_d-th
            t_plex = top_tie >> 10
            tl.store(sc_ws + off + q, unordered(top_ord), mask=in_d)
            tl.store(par_ws + off + q, tl.load(poslex_ws + off_prev + t_plex, mask=in_d, other=0), mask=in_d)
            tl.store(rank_ws + off + q, top_tie & 1023, mask=in_d)
            tl.store(plex_ws + off + q, t_plex, mask=in_d)
            # children scoring exactly S may lie beyond the examined ones only below a saturated row
            saturated = tl.sum((valid & saturable & (ordered(child) >= star)).to(tl.int32), 0)
            if saturated > 0:
                tl.debug_barrier()
                s_star = unordered(star)
                n_above = tl.sum((in_d & (top_ord > star)).to(tl.int32), 0)
                lv = q < m_prev  # lanes = parents in lexicographic order
                ppos = tl.load(poslex_ws + off_prev + q, mask=lv, other=0)
                psc = tl.load(sc_ws + off_prev + ppos, mask=lv, other=0.0)
                lo = _count_above(lp_req + d * K, psc, s_star, K, lv, True, LOGK)
                hi = _count_above(lp_req + d * K, psc, s_star, K, lv, False, LOGK)
                n_tie = tl.where(lv, hi - lo, 0)
                tie_end = tl.cumsum(n_tie, 0)
                tie_start = tie_end - n_tie
                want = m_d - n_above
                take = tl.minimum(n_tie, tl.maximum(want - tie_start, 0))
                tl.store(tie_ws + q, q * 0 - 1)
                tl.debug_barrier()
                tl.store(tie_ws + tie_start, q, mask=take > 0)
                tl.debug_barrier()
                owner = tl.associative_scan(tl.load(tie_ws + q), 0, max_combine)  # slot t -> parent lex rank
                slot_ok = (q < want) & (owner >= 0)
                owner = tl.where(slot_ok, owner, 0)
                dst = n_above + q
                tl.store(sc_ws + off + dst, q.to(tl.float32) * 0.0 + s_star, mask=slot_ok)
                tl.store(par_ws + off + dst, tl.gather(ppos, owner, 0), mask=slot_ok)
                tl.store(rank_ws + off + dst, tl.gather(lo, owner, 0) + q - tl.gather(tie_start, owner, 0),
                         mask=slot_ok)
                tl.store(plex_ws + off + dst, owner, mask=slot_ok)
            tl.debug_barrier()
            # lexicographic ranks within A_d: order of (lex(parent), rank)
            a_plex = tl.load(plex_ws + off + q, mask=in_d, other=0)
            a_rank = tl.load(rank_ws + off + q, mask=in_d, other=0)
            lkey = tl.where(in_d, (((a_plex << 10) | a_rank) << 11) | q, 2147483647)
            lkey = tl.sort(lkey)
            at = lkey & 2047
            tl.store(lex_ws + off + at, q, mask=in_d)
            tl.store(poslex_ws + off + q, at, mask=in_d)
            tl.store(cnt_ws + d, m_d)
            tl.debug_barrier()
            m_prev = m_d

    # the tree: the B best of the union of the A_d by (-score, depth, position)
    dd = tl.arange(0, D_PAD)[:, None]
    qq = tl.arange(0, B_PAD)[None, :]
    m_all = tl.load(cnt_ws + dd, mask=dd < D, other=0)  # [D_PAD, 1]
    u_ok = (dd < D) & (qq < m_all)
    u_score = tl.load(sc_ws + dd * B_PAD + qq, mask=u_ok, other=0.0)
    u_key = tl.where(u_ok, pack(u_score, (dd << 11) | qq), -9223372036854775807 - 1)  # [D_PAD, B_PAD]
    best = tl.topk(tl.reshape(u_key, [D_PAD * B_PAD]), B_PAD)
    best_ord, best_tie = unpack(best)
    j = q  # node j + 1
    jv = j < B
    nd = tl.where(jv, best_tie >> 11, 0)
    nq = tl.where(jv, best_tie & 2047, 0)
    tl.store(node_ws + nd * B_PAD + nq, j + 1, mask=jv)
    rk = tl.load(rank_ws + nd * B_PAD + nq, mask=jv, other=0)
    tok = tl.load(ids_req + nd * K + rk, mask=jv, other=0)
    tl.store(anc_ws + j, j + 1, mask=jv)  # level 0: the node itself
    tl.debug_barrier()
    pp = tl.load(par_ws + nd * B_PAD + nq, mask=jv & (nd > 0), other=0)
    parent = tl.where(nd > 0, tl.load(node_ws + (nd - 1) * B_PAD + pp, mask=jv & (nd > 0), other=0), 0)
    out = req * N + j + 1
    tl.store(tok_ptr + out, tok.to(tl.int64), mask=jv)
    tl.store(par_out_ptr + out, parent, mask=jv)
    tl.store(dep_out_ptr + out, nd + 1, mask=jv)
    start = tl.load(start_ptr + req).to(tl.int64)  # int32 or int64
    tl.store(pos_out_ptr + out, start + (nd + 1).to(tl.int64), mask=jv)
    first = j == 0
    if HAS_SCORES:  # the prefix's score, as kept in A_d (the same fp32 sums as the reference's)
        tl.store(sc_out_ptr + out, unordered(best_ord), mask=jv)
        tl.store(sc_out_ptr + req * N + j, j.to(tl.float32) * 0.0, mask=first)
    tl.store(tok_ptr + req * N + j, tl.load(root_ptr + req + j * 0, mask=first, other=0), mask=first)
    tl.store(par_out_ptr + req * N + j, j * 0 - 1, mask=first)
    tl.store(dep_out_ptr + req * N + j, j * 0, mask=first)
    tl.store(pos_out_ptr + req * N + j, start + j * 0, mask=first)
    # ancestors: walk up the kept prefixes (level l = the l-th ancestor, -1 past depth 1)
    cur_d = nd
    cur_q = nq
    for lvl in range(1, D_PAD):
        up = jv & (cur_d > 0)
        cur_q = tl.where(up, tl.load(par_ws + cur_d * B_PAD + cur_q, mask=up, other=0), cur_q)
        cur_d = tl.where(up, cur_d - 1, cur_d)
        anc = tl.where(up, tl.load(node_ws + cur_d * B_PAD + cur_q, mask=up, other=0), -1)
        tl.store(anc_ws + lvl * B_PAD + j, anc, mask=jv)
    tl.debug_barrier()
    a = tl.load(anc_ws + dd * B_PAD + qq, mask=(dd < D) & (qq < B), other=-1)  # [D_PAD, B_PAD]
    a_word = a >> 6
    a_bit = tl.full([D_PAD, B_PAD], 1, tl.int64) << (a & 63).to(tl.int64)
    for w in range(W_MAX):
        if w < W:
            bits = tl.sum(tl.where((a >= 0) & (a_word == w), a_bit, 0), 0)  # distinct bits: sum == or
            bits = bits + tl.where(w == 0, 1, 0)  # the root
            tl.store(mask_ptr + (req * N + j + 1) * W + w, bits, mask=jv)
            tl.store(mask_ptr + (req * N + j) * W + w, tl.where(w == 0, 1, 0).to(tl.int64) + j * 0, mask=first)


def build_tree_triton(lp, ids, root, start, tokens, parents, depth, positions, mask, ws, scores=None) -> None:
    """lp, ids [b, D, K] sorted candidates (ws.lp / ws.ids) -> the five outputs (and scores [b, N] fp32 when
    given), written in place."""
    b, n = tokens.shape
    budget = n - 1
    w = mask.shape[2]
    logk = ws.b_pad.bit_length()  # binary search over [0, K], K <= B_PAD: ceil(log2(K + 1)) steps suffice
    warps = 4 if ws.p_pad <= 512 else (8 if ws.p_pad <= 2048 else 16)
    _tree_kernel[(b,)](lp, ids, root, start, tokens, parents, depth, positions, mask,
                       scores if scores is not None else ws.score,  # a placeholder pointer, never written
                       ws.score, ws.ints, ws.table, ws.k, budget, ws.depth, w,
                       B_PAD=ws.b_pad, P_PAD=ws.p_pad, D_PAD=ws.d_pad, W_MAX=ws.b_pad // 64 + 1, LOGK=logk,
                       HAS_SCORES=scores is not None, **pdl_args(pdl_for(lp)), num_warps=warps)
