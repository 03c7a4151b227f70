"""Triton routing + grouping for moe_w4a16: noaux_tc top-k per token, then tokens bucketed by expert.

One program per BT tokens (BT = 1, one warp, by default: each pick is one warp-shuffle reduction of the
row's packed (choice, expert id) keys, no shared memory, no barrier).  Routing is route_reference's
function (sigmoid, + correction bias for the choice, group-limited when N_GROUP > 1, unbiased weights
normalised and scaled); ties go to the lower expert index.  Grouping has no host round trip and no sort:
each (token, slot) routed to a local
expert takes a place in that expert's fixed-capacity list by an atomic increment of its counter
(capacity t: a token picks an expert at most once); the slot that takes place 0 also appends the
expert to the list of active experts.  The order inside a list is whatever the atomics give; the
GEMMs compute each row independently, so the results do not depend on it.

With SHARED the launch also forms the shared expert's activation, silu(gate) * up of each token (the router's
GEMM also computes the shared expert's gate_up: runtime/model/moe.py), in programs of its own beside the routing
ones (grid (t, 2)): one launch fewer per MoE layer, and nothing in front of the routing.

Workspace (int32, zeroed before the launch): counts [e_local + 1] (the last entry counts active
experts), active [e_local], lists [e_local, t] holding slot ids s = token * K + j.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plugins.common.activation_kernel import silu_mul_rounded
from plugins.common.keys import pack, unpack
from plugins.common.pdl import pdl_args, pdl_for, pdl_prologue

# One token without the list of active experts (v3's AR step): the counts and lists by plain stores, not atomics (each
# pick is a distinct expert, so each count goes 0 -> 1 and the slot is its list's only entry): the same values, one
# L2 atomic round trip fewer before the lists are written.  On since measured (H100, K2.6 rank at 40 layers, 4K,
# k26-switches-h100.json call 12): AR step 3425.6 -> 3396.5 µs (-0.85 %, predicted ~-28 µs), DDTree rounds unchanged.
ONE_TOKEN_STORES = True
KEY_NONE = tl.constexpr(-(2**63))  # below every packed key: a lane already picked, masked or outside the allowed groups


@triton.jit
def route_kernel(logits_ptr, bias_ptr, idx_ptr, w_ptr, counts_ptr, active_ptr, lists_ptr,
                 T, E, stride_l, e_start, e_local, scaling, su_ptr, h_ptr, I_SH, stride_su, stride_h,
                 K: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, NORM: tl.constexpr,
                 BT: tl.constexpr, BE: tl.constexpr, BKK: tl.constexpr, BG: tl.constexpr,
                 SHARED: tl.constexpr, BS: tl.constexpr, IEEE_EXP: tl.constexpr, PDL: tl.constexpr,
                 ACTIVE: tl.constexpr = True, ONE_TOKEN: tl.constexpr = False):
    pdl_prologue(PDL)
    NEG = float("-inf")
    pid = tl.program_id(0)
    rt = pid * BT + tl.arange(0, BT)  # [BT] tokens
    # program (p, 1): the shared expert's h [t, I_SH] = silu(gate) * up of its gate_up rows (another GEMM's
    # columns), beside the routing programs (p, 0) instead of in front of them
    if SHARED:
        if tl.program_id(1) == 1:
            rs = tl.arange(0, BS)
            c0 = pid * 0  # a while loop (a runtime trip count) also runs in the interpreter
            while c0 < I_SH:
                cols = c0 + rs  # [BS]
                m2 = (rt < T)[:, None] & (cols < I_SH)[None, :]  # [BT, BS]
                g = tl.load(su_ptr + rt[:, None] * stride_su + cols[None, :], mask=m2, other=0.0)
                u = tl.load(su_ptr + rt[:, None] * stride_su + I_SH + cols[None, :], mask=m2, other=0.0)
                tl.store(h_ptr + rt[:, None] * stride_h + cols[None, :],
                         silu_mul_rounded(g, u, h_ptr.dtype.element_ty, IEEE_EXP), mask=m2)
                c0 += BS
    if tl.program_id(1) == 0:  # the routing of token pid
        re = tl.arange(0, BE)  # [BE] experts (padded to a power of two)
        tmask = rt < T
        emask = re < E
        lg = tl.load(logits_ptr + rt[:, None] * stride_l + re[None, :], mask=tmask[:, None] & emask[None, :], other=0.0)
        scores = tl.sigmoid(lg.to(tl.float32))  # [BT, BE]
        bias = tl.load(bias_ptr + re, mask=emask, other=0.0).to(tl.float32)  # [BE]
        choice = tl.where(emask[None, :], scores + bias[None, :], NEG)  # [BT, BE]

        if N_GROUP > 1:
            # group score = sum of the group's two best choices; keep the TOPK_GROUP best groups
            gid = re // (E // N_GROUP)  # [BE]
            rg = tl.arange(0, BG)
            gscore = tl.full([BT, BG], NEG, tl.float32)
            for g in tl.static_range(N_GROUP):
                cg = tl.where((gid == g)[None, :], choice, NEG)
                m1 = tl.max(cg, axis=1)
                i1 = tl.min(tl.where(cg == m1[:, None], re[None, :], BE), axis=1)
                m2 = tl.max(tl.where(re[None, :] == i1[:, None], NEG, cg), axis=1)
                gscore = tl.where(rg[None, :] == g, (m1 + m2)[:, None], gscore)
            keep = tl.zeros([BT, BE], tl.int32)
            for r in tl.static_range(TOPK_GROUP):
                mg = tl.max(gscore, axis=1)
                ig = tl.min(tl.where(gscore == mg[:, None], rg[None, :], BG), axis=1)  # [BT]
                keep = tl.where(gid[None, :] == ig[:, None], 1, keep)
                gscore = tl.where(rg[None, :] == ig[:, None], NEG, gscore)
            choice = tl.where(keep != 0, choice, NEG)

        # one reduction per pick: the packed key (choice desc, expert id asc) of each lane, max over the row
        key = tl.where(emask[None, :] & (choice > NEG), pack(choice, re[None, :]), KEY_NONE)  # [BT, BE] int64
        rk = tl.arange(0, BKK)  # [BKK] slots (padded)
        sel_i = tl.zeros([BT, BKK], tl.int32)
        sel_w = tl.zeros([BT, BKK], tl.float32)
        for j in tl.static_range(K):
            m = tl.max(key, axis=1)  # [BT]
            ij = unpack(m)[1]  # [BT] the pick (lowest id among equal choices)
            hit = re[None, :] == ij[:, None]  # [BT, BE]
            key = tl.where(hit, KEY_NONE, key)
            sel_i = tl.where(rk[None, :] == j, ij[:, None], sel_i)
            # its unbiased score, taken from the row in registers (one term: the sum is exact)
            sel_w = tl.where(rk[None, :] == j, tl.sum(tl.where(hit, scores, 0.0), axis=1)[:, None], sel_w)
        kmask = tmask[:, None] & (rk[None, :] < K)  # [BT, BKK]
        sel_w = tl.where(kmask, sel_w, 0.0)
        if NORM:
            sel_w = sel_w / (tl.sum(sel_w, axis=1)[:, None] + 1e-20)
        sel_w = sel_w * scaling

        slot = rt[:, None] * K + rk[None, :]  # [BT, BKK]
        tl.store(idx_ptr + slot, sel_i, mask=kmask)
        tl.store(w_ptr + slot, sel_w, mask=kmask)

        le = sel_i - e_start  # local expert index
        local = kmask & (le >= 0) & (le < e_local)
        le = tl.where(local, le, 0)
        if ONE_TOKEN:  # t = 1: each picked expert's list is this slot alone (its count 0 -> 1), no atomics
            pos = tl.zeros([BT, BKK], tl.int32)
            tl.store(counts_ptr + le, pos + 1, mask=local)
        else:
            pos = tl.atomic_add(counts_ptr + le, 1, mask=local)  # [BT, BKK] place in the expert's list
        if ACTIVE:  # the list of active experts (v2c's kernels walk it; v3 reads the counts only)
            first = local & (pos == 0)
            a = tl.atomic_add(counts_ptr + e_local + le * 0, 1, mask=first)
            tl.store(active_ptr + a, le, mask=first)
        tl.store(lists_ptr + le * T + pos, slot, mask=local)


def launch_route(logits: torch.Tensor, bias: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor,
                 counts: torch.Tensor, active: torch.Tensor, lists: torch.Tensor, e_start: int, e_local: int,
                 scaling: float, top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool,
                 shared_gate_up: torch.Tensor | None = None, shared_h: torch.Tensor | None = None,
                 active_list: bool = True) -> None:
    """route_kernel over logits [t, e] (rows may be strided): one token per one-warp program, each pick a
    warp-shuffle reduction.  With shared_gate_up [t, 2i] (unit stride along 2i) and shared_h [t, i] (x's
    dtype), one more program per token writes shared_h = silu(gate) * up (plugins/common/activation_kernel.py).
    active_list False: no
    list of active experts (active and counts[e_local] untouched; one dependent atomic fewer), for v3, which walks
    the counts."""
    t, e = logits.shape
    shared = shared_h is not None
    i_sh = shared_h.shape[1] if shared else 0
    route_kernel[(t, 2 if shared else 1)](
        logits, bias, topk_idx, topk_w, counts, active, lists, t, e, logits.stride(0), e_start, e_local,
        float(scaling), shared_gate_up if shared else logits, shared_h if shared else logits, i_sh,
        shared_gate_up.stride(0) if shared else 0, shared_h.stride(0) if shared else 0, K=top_k,
        N_GROUP=n_group, TOPK_GROUP=topk_group, NORM=bool(norm_topk_prob), BT=1, BE=next_pow2(e),
        BKK=next_pow2(top_k), BG=next_pow2(n_group), SHARED=shared, BS=min(1024, next_pow2(max(i_sh, 1))),
        IEEE_EXP=logits.is_cuda, num_warps=1, ACTIVE=active_list,
        ONE_TOKEN=ONE_TOKEN_STORES and t == 1 and not active_list, **pdl_args(pdl_for(logits)))


def next_pow2(n: int) -> int:
    """The smallest power of two >= max(n, 2) (tile extents; 2 keeps every arange a real vector)."""
    return 1 << max(1, (n - 1).bit_length())
