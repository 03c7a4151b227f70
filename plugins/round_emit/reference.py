"""round_emit: the end of a decode round for b requests, in torch (the CPU path and the kernel's oracle).

A round proposes cand [b, a] tokens per request, the first count[r] of them real (0 for a frozen request).
Emitted are those up to and including the first stop token or the max_new-th token of the request; the
request stops there.  Written: produced += emitted, live = 0 for a request that stopped, and the round's
host row out[r] = [cand[r, :a] | emitted | live | count | nonfinite] (out's later columns untouched); the
nonfinite flag, read into the row, is cleared (posterior only ever sets it).

AR rounds (bonus given): one candidate, the next token, real for live requests: count := live (count is
the round's accept length) and bonus := cand[:, 0] where live, before the emission above; given cache_lens
[b] int32 (the step's kv_commit ran with advance=False), also cache_lens += count: the committed row's
advance, in this launch instead of one of its own.

Tree rounds (tokens given, cand None): the candidates come from the accepted path.  count := count * live
(frozen requests accept nothing), path[r, j] = tokens[r, path_idx[r, j]] (root first; slots past the accept
length are stale indices, still < N), ctx_tokens := path (the drafter's next context), and cand[r, j] = the
path's token after slot j, bonus[r] at the last accepted slot: what the round emits past the root.
"""

from __future__ import annotations

import torch


def round_emit_reference(cand: torch.Tensor | None, count: torch.Tensor, stop_ids: torch.Tensor,
                         produced: torch.Tensor, max_new: torch.Tensor, live: torch.Tensor, nonfinite: torch.Tensor,
                         out: torch.Tensor, bonus: torch.Tensor | None = None, tokens: torch.Tensor | None = None,
                         path_idx: torch.Tensor | None = None, ctx_tokens: torch.Tensor | None = None,
                         cache_lens: torch.Tensor | None = None) -> None:
    """cand [b, a] int64, count [b] int32, stop_ids [b, S] int64 (-1 padded), produced / max_new / live [b]
    int32, nonfinite [b] int64, out [b, >= a + 4] int64, bonus [b] int64 or None; a tree round instead gives
    cand None, tokens [b, N] int64, path_idx [b, a] int32, ctx_tokens [b, a] int64; cache_lens [b] int32 (AR
    only) or None (see the module doc)."""
    if tokens is not None:  # tree round: the candidates are the accepted path's, then the bonus
        count.mul_(live)
        path = tokens.gather(1, path_idx.long())  # [b, a] root first
        ctx_tokens.copy_(path)
        slot = torch.arange(path.shape[1], device=path.device)  # [a]
        last = (count.long() - 1)[:, None]  # [b, 1]
        cand = torch.where(slot[None, :] == last, bonus[:, None], path.roll(-1, 1))  # [b, a]
        bonus = None
    b, a = cand.shape
    if bonus is not None:  # AR: the next token is real for live requests
        count.copy_(live)
        bonus.copy_(torch.where(live.bool(), cand[:, 0], bonus))
        if cache_lens is not None:
            cache_lens += count
    slot = torch.arange(a, device=cand.device)[None, :]  # [1, a]
    valid = slot < count[:, None]  # [b, a]
    stop = (cand[:, :, None] == stop_ids[:, None, :]).any(-1)  # [b, a]
    full = (produced[:, None] + slot + 1) >= max_new[:, None]  # [b, a]
    fin = (valid & (stop | full)).to(torch.int32)  # [b, a]
    keep = valid & ((fin.cumsum(1) - fin) == 0)  # nothing finished before this slot
    n = keep.sum(1).to(torch.int32)  # [b]
    produced.add_(n)
    live.mul_(1 - fin.amax(1))
    out[:, :a].copy_(cand)
    out[:, a].copy_(n)
    out[:, a + 1].copy_(live)
    out[:, a + 2].copy_(count)
    out[:, a + 3].copy_(nonfinite)
    nonfinite.zero_()  # read: the next pick sets it afresh
