"""Reference (torch, CPU and CUDA) for tree_verify_mla: absorbed MLA over a latent cache plus a tree.

Shapes: b requests, n tree nodes (queries) per request, h heads, l_max cache capacity,
d_qk = d_v + d_r latent row width (576 for Kimi: c_kv 512 | k_pe 64), d_v value width (512), w mask words.

    q          [b, n, h, d_qk]   absorbed queries (q_nope @ W_UK | roped q_pe)
    cache      [b, l_max, d_qk]  committed latent cache; rows [0, cache_lens[i]) are valid
    cache_lens [b] int32
    tree_kv    [b, n, d_qk]      latent rows of the n tree nodes (scratch, not the committed cache)
    tree_mask  [b, n, w] int64   ancestor bitmask (plugins/common/bitmask.py), self included
    scale      float             softmax scale
    out        [b, n, h, d_v]    written: softmax(q k^T * scale) v, values = first d_v dims of each row
    lse        [b, n, h] fp32    written: natural-log sum of exp of the scaled, visible scores

Node i of request r attends to all committed rows of r and to the tree rows its mask allows.
Scores and softmax are fp32 whatever the input dtype.
"""

from __future__ import annotations

import torch

from plugins.common.bitmask import unpack_mask
from plugins.common.precision import acc


def tree_verify_mla_reference(q: torch.Tensor, cache: torch.Tensor, cache_lens: torch.Tensor, tree_kv: torch.Tensor,
                              tree_mask: torch.Tensor, scale: float, out: torch.Tensor, lse: torch.Tensor) -> None:
    b, n, h, d_qk = q.shape
    d_v = out.shape[-1]
    valid = min(int(cache_lens.max()), cache.shape[1]) if b else 0  # rows past every request's length never count
    keys = torch.cat([cache[:, :valid], tree_kv], dim=1)
    keys = acc(keys)  # [b, valid + n, d_qk]
    scores = torch.bmm(acc(q).reshape(b, n * h, d_qk), keys.transpose(1, 2)).view(b, n, h, valid + n) * scale
    cache_ok = torch.arange(valid, device=q.device)[None, :] < cache_lens[:, None].long()  # [b, valid]
    ok = torch.cat([cache_ok[:, None, :].expand(b, n, valid), unpack_mask(tree_mask, n)], dim=-1)  # [b, n, valid+n]
    scores = scores.masked_fill(~ok[:, :, None, :], float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)  # [b, n, h, 1]; finite: every node sees itself
    p = torch.exp(scores - m)
    l = p.sum(dim=-1, keepdim=True)
    o = torch.bmm(p.view(b, n * h, valid + n), keys[..., :d_v]).view(b, n, h, d_v) / l
    out.copy_(o)
    lse.copy_((m + torch.log(l))[..., 0])
