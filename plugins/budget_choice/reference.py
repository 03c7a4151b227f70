"""Reference (torch, every device) of budget auto's per-round choice and calibration (runtime/decode/budget.py
says what they mean).  Shapes: b requests, N tree nodes (root first), nb buckets, a accepted-path slots.

select:  scores [b, N] fp32 path log-probs, live [b] int32, sizes [nb] int64 (the buckets, ascending),
         seen [2, nb] fp32 and covered [nb] bool (the calibration), force [1] int64 (-1: choose), cap_cost
         [nb, nb] fp32 (T(b) + C_j, [cap j, bucket b]), value [2, nb] fp32 (the caps' decayed tokens and µs),
         cap (index: the tree built this round), min_cap (the smallest cap index ever built)
         -> writes extra [nb] (the drafter's expected extra tokens per bucket), pick [] int64, hot [nb] bool
            and, in a full round (cap == nb - 1), value and hint [] int64.
observe: accept_len [b] int32, accept_idx [b, a] int32 (the accepted path's node indices, root first),
         sizes, verified (the bucket size this round verified), extra -> writes seen, covered.
"""

from __future__ import annotations

import torch

DECAY = 0.9  # per round, of the accepted / predicted sums behind the calibration s (~10 rounds' memory)
S_MIN, S_MAX = 0.25, 4.0


def extra_tokens(scores: torch.Tensor, live: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """scores [b, N] fp32 path log-probs (root 0), live [b], sizes [nb] int64 buckets -> [nb] fp32: the
    drafter's expected accepted nodes of the first b, summed over live requests (no bonus, no s)."""
    cum = scores[:, 1:].exp().cumsum(1)  # [b, N - 1] sum of path probabilities of nodes 1..i
    return (cum.index_select(1, sizes - 1) * live[:, None].to(cum.dtype)).sum(0)  # [nb]


def expected_tokens(scores: torch.Tensor, live: torch.Tensor, sizes: torch.Tensor, scale=1.0) -> torch.Tensor:
    """E(b) [nb] fp32: live requests + scale * extra_tokens."""
    return live.sum().to(torch.float32) + scale * extra_tokens(scores, live, sizes)


def choose(extra: torch.Tensor, live: torch.Tensor, cost_us: torch.Tensor, scale=1.0) -> torch.Tensor:
    """The bucket index [] int64 maximising expected tokens per µs, (live requests + scale * extra) / cost_us
    (extra [nb] from extra_tokens, cost_us [nb] fp32 = T(b) + C).  The first maximum wins (the smaller bucket)."""
    return ((live.sum().to(torch.float32) + scale * extra) / cost_us).argmax()


def calibration(seen: torch.Tensor, covered: torch.Tensor) -> torch.Tensor:
    """s [nb] fp32: per bucket, accepted over predicted extra tokens (seen [2, nb]), within [S_MIN, S_MAX]; a
    bucket never measured takes the largest measured bucket's below it (1 if none)."""
    index = torch.arange(seen.shape[1], device=seen.device)
    s = (seen[0] / seen[1]).clamp(S_MIN, S_MAX)  # [nb]
    known = torch.where(covered, index, torch.zeros_like(index)).cummax(0).values  # [nb]
    return torch.where(covered[known], s.gather(0, known), s.new_ones(()))


def select_reference(scores: torch.Tensor, live: torch.Tensor, sizes: torch.Tensor, seen: torch.Tensor,
                     covered: torch.Tensor, force: torch.Tensor, cap_cost: torch.Tensor, value: torch.Tensor,
                     hint: torch.Tensor, extra: torch.Tensor, pick: torch.Tensor, hot: torch.Tensor, cap: int,
                     min_cap: int) -> None:
    nb = sizes.shape[0]
    index = torch.arange(nb, device=sizes.device)
    extra.copy_(extra_tokens(scores, live, sizes))  # [nb]
    s = calibration(seen, covered)  # [nb]
    if cap == nb - 1:
        tokens = live.sum().to(torch.float32) + s * extra  # [nb] E(b)
        below = index[None, :] <= index[:, None]  # [cap, bucket] bucket verifiable under the cap
        rate = torch.where(below, tokens[None, :] / cap_cost, -1.0)  # [cap, bucket]
        best = rate.argmax(1, keepdim=True)  # [nb, 1] each cap's pick (the first maximum: the smaller bucket)
        chosen = best[-1, 0]
        got = torch.stack([tokens.gather(0, best[:, 0]), cap_cost.gather(1, best)[:, 0]])  # [2, nb]
        w = (live.sum() > 0).to(torch.float32)  # a frozen round scores nothing
        value.mul_(1 - w * (1 - DECAY)).add_(got * w)
        ratio = value[0] / value[1].clamp(min=1e-30)  # [nb] tokens per µs per cap (0 before any)
        ratio = torch.where(index >= min_cap, ratio, -1.0)  # caps below the smallest built are not candidates
        hint.copy_(nb - 1 - ratio.flip(0).argmax())  # ties to the larger cap
    else:
        chosen = choose(extra[:cap + 1], live, cap_cost[cap, :cap + 1], s[:cap + 1])
    f = force[0]
    pick.copy_(torch.where(f >= 0, f, chosen))
    torch.eq(index, pick, out=hot)


def observe_reference(accept_len: torch.Tensor, accept_idx: torch.Tensor, sizes: torch.Tensor, verified: int,
                      extra: torch.Tensor, seen: torch.Tensor, covered: torch.Tensor) -> None:
    a = accept_idx.shape[1]
    slot = torch.arange(a, device=accept_idx.device)  # [a]
    on_path = (slot[None, :] >= 1) & (slot[None, :] < accept_len[:, None])  # [b, a] accepted, past the root
    within = accept_idx[:, :, None].long() <= sizes[None, None, :]  # [b, a, nb]
    got = (within & on_path[:, :, None]).sum((0, 1)).to(torch.float32)  # [nb]
    # [nb] buckets inside the verified tree, when a request was live (frozen rounds measure nothing)
    cover = (sizes <= verified) & (accept_len.sum() > 0)
    covered |= cover
    w = cover.to(torch.float32)  # [nb]
    seen.mul_(1 - w * (1 - DECAY)).add_(torch.stack([got, extra]) * w)
