"""The DFlash drafter's block attention, in torch: the oracle of kernel.py and the path of every device but CUDA.

Letters: b requests, s block slots (queries per head), h query heads, g kv heads (h = g * rep), e head_dim,
cap cache rows.  Each request's block attends, without a causal mask, to the cache rows [0, visible[r]): its
committed context and, written just before, the block's own rows.  Scores and softmax in fp32 from the
products of the stored values summed in fp32; the probabilities rounded to the cache's dtype for the second
product (as flash attention rounds them), summed in fp32 and rounded once to q's dtype.
"""

from __future__ import annotations

import torch

from plugins.common.precision import acc


def drafter_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                visible: torch.Tensor, scale: float) -> torch.Tensor:
    """q [b, s, h, e], k_cache / v_cache [b, cap, g, e], visible [b] int (>= 1) -> [b, s, h*e] in q's dtype.

    Each kv head's rep query heads are folded into its s queries, so K and V are read as stored (strided
    views, no repeated copy) and both products are batched GEMMs over the cache rows."""
    b, s, h, e = q.shape
    cap, g = k_cache.shape[1], k_cache.shape[2]
    rep = h // g
    qg = q.view(b, s, g, rep, e).permute(0, 2, 3, 1, 4).reshape(b * g, rep * s, e)  # [b*g, rep*s, e]
    k = k_cache.transpose(1, 2).reshape(b * g, cap, e)  # [b*g, cap, e]
    v = v_cache.transpose(1, 2).reshape(b * g, cap, e)
    scores = torch.bmm(acc(qg), acc(k).transpose(1, 2)).view(b, g, rep * s, cap) * scale  # [b, g, rep*s, cap]
    hidden = torch.arange(cap, device=q.device)[None, :] >= visible.to(q.device)[:, None]  # [b, cap]
    p = scores.masked_fill(hidden[:, None, None, :], float("-inf")).softmax(-1)
    out = torch.bmm(acc(p.view(b * g, rep * s, cap).to(v.dtype)), acc(v)).to(q.dtype)  # [b*g, rep*s, e]
    return out.view(b, g, rep, s, e).permute(0, 3, 1, 2, 4).reshape(b, s, h * e)
