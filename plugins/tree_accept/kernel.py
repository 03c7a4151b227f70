"""Triton kernel for tree_accept: one program per request walks the verified tree along the posterior.

Shapes: b requests, N tree nodes (root first), a accept capacity; see reference.py for the contract.

Per program (request r) the whole tree sits in registers as blocks of next_pow2(N) lanes:
  good[j] = j >= 1 and 0 <= parents[j] < N and tokens[j] == posterior[parents[j]]
(one gather of the posterior at the parent), so node j is the child the target picks after its
parent.  The walk is then cur = 0; while some j with parents[j] == cur and good[j]: cur = the
smallest such j (the reference's `setdefault` keeps the first child with a token, so duplicate
sibling tokens resolve the same way).  Each step is one masked min-reduction over the block; the
loop runs accept_len - 1 times (<= D on valid trees).

Device-side capacity: the walk stops when the path holds a nodes (a = accept_idx.shape[1]), with
accept_len = a and bonus = posterior[path[a - 1]].  The reference raises instead; on valid trees
(depth <= a - 1) the cap never applies, and the capped output is still a lossless round (each
emitted token is the target's choice given the accepted prefix).  Nothing else is checked on the
device: out-of-range parents simply never match.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plugins.common.pdl import pdl_args, pdl_for, pdl_prologue

MAX_NODES = 8192  # one program keeps 3 blocks of next_pow2(N) lanes in registers


@triton.jit
def _tree_accept_kernel(post_ptr, tok_ptr, par_ptr, idx_ptr, len_ptr, bonus_ptr, n, a,
                        s_post, s_tok, s_par, s_idx, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)  # [BLOCK] node index
    inside = offs < n
    par = tl.load(par_ptr + r * s_par + offs, mask=inside, other=-1)  # [BLOCK] int32
    tok = tl.load(tok_ptr + r * s_tok + offs, mask=inside, other=0)  # [BLOCK] int64
    own = tl.load(post_ptr + r * s_post + offs, mask=inside, other=0)  # [BLOCK] posterior at the node itself
    has_par = inside & (offs >= 1) & (par >= 0) & (par < n)
    want = tl.load(post_ptr + r * s_post + par, mask=has_par, other=0)  # [BLOCK] posterior at the parent
    good = has_par & (tok == want)
    big: tl.constexpr = BLOCK
    tl.store(idx_ptr + r * s_idx, 0)
    cur = tl.zeros((), dtype=tl.int32)
    length = tl.full((), 1, dtype=tl.int32)
    nxt = tl.min(tl.where(good & (par == cur), offs, big), axis=0)
    go = (nxt < big) & (length < a)
    while go:
        tl.store(idx_ptr + r * s_idx + length, nxt)
        cur = nxt
        length += 1
        nxt = tl.min(tl.where(good & (par == cur), offs, big), axis=0)
        go = (nxt < big) & (length < a)
    tl.store(len_ptr + r, length)
    # the bonus from registers (a masked sum picks own[cur]): no dependent global load after the walk
    tl.store(bonus_ptr + r, tl.sum(tl.where(offs == cur, own, 0), axis=0))


def _warps(block: int) -> int:
    """One warp per 32 lanes up to 8 warps.  H200 sweep (one call per graph, µs, warps 1/4/8): B = 256
    b = 1 8.35/6.11/6.08, b = 64 9.73/-/6.96; B = 1024 b = 1 8.96 (4 warps)/6.91 (8): the loads and
    the gather spread over more warps beat keeping the per-step reduction inside one warp."""
    return min(8, max(1, block // 32))


def tree_accept_triton(posterior: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                       accept_idx: torch.Tensor, accept_len: torch.Tensor, bonus: torch.Tensor,
                       num_warps: int | None = None) -> None:
    """posterior/tokens [b, N] int64, parents [b, N] int32 -> accept_idx [b, a] int32 (slots >= accept_len
    untouched), accept_len [b] int32, bonus [b] int64.  Static checks only; no host sync, no allocation.
    num_warps overrides the size heuristic (benchmark sweeps)."""
    check_tree_accept(posterior, tokens, parents, accept_idx, accept_len, bonus)
    b, n = tokens.shape
    if b == 0:
        return
    block = max(triton.next_power_of_2(n), 16)
    _tree_accept_kernel[(b,)](posterior, tokens, parents, accept_idx, accept_len, bonus, n, accept_idx.shape[1],
                              posterior.stride(0), tokens.stride(0), parents.stride(0), accept_idx.stride(0),
                              BLOCK=block, num_warps=num_warps or _warps(block), **pdl_args(pdl_for(tokens)))


def check_tree_accept(posterior, tokens, parents, accept_idx, accept_len, bonus) -> None:
    """Shape, dtype, device and layout checks of the kernel path (ValueError naming the tensor)."""
    if tokens.dim() != 2:
        raise ValueError(f"tree_accept: tokens must be [b, N], got {tuple(tokens.shape)}")
    b, n = tokens.shape
    want = {"posterior": (posterior, (b, n), torch.int64), "tokens": (tokens, (b, n), torch.int64),
            "parents": (parents, (b, n), torch.int32), "accept_len": (accept_len, (b,), torch.int32),
            "bonus": (bonus, (b,), torch.int64)}
    for name, (t, shape, dtype) in want.items():
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"tree_accept: {name} must be {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")
    if accept_idx.dim() != 2 or accept_idx.shape[0] != b or accept_idx.shape[1] < 1 or accept_idx.dtype != torch.int32:
        raise ValueError(f"tree_accept: accept_idx must be torch.int32 [{b}, a >= 1], got {accept_idx.dtype} "
                         f"{list(accept_idx.shape)}")
    if not 1 <= n <= MAX_NODES:
        raise ValueError(f"tree_accept: N must be in 1..{MAX_NODES}, got {n}")
    for name, t in (("posterior", posterior), ("tokens", tokens), ("parents", parents), ("accept_idx", accept_idx)):
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"tree_accept: {name} must have a contiguous last dim, got strides {t.stride()}")
        if t.device != tokens.device:
            raise ValueError(f"tree_accept: {name} is on {t.device}, tokens on {tokens.device}")
    for name, t in (("accept_len", accept_len), ("bonus", bonus)):
        if t.device != tokens.device or (b > 1 and t.stride(0) != 1):
            raise ValueError(f"tree_accept: {name} must be contiguous on {tokens.device}")
