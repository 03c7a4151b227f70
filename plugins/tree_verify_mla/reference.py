"""Reference (torch, CPU and CUDA) for tree_verify_mla: absorbed MLA over a latent cache plus a tree.

Shapes: b requests, n tree nodes (queries) per request, h heads, l_max cache capacity,
d_qk = d_v + d_r latent row width (576 for Kimi: c_kv 512 | k_pe 64), d_v value width (512), w mask words.

    q          [b, n, h, d_qk]   absorbed queries (q_nope @ W_UK | roped q_pe)
    cache      [b, l_max, d_qk]  committed latent cache; rows [0, cache_lens[i]) are valid
    cache_lens [b] int32
    tree_kv    [b, n, d_qk]      latent rows of the n tree nodes (scratch, not the committed cache)
    tree_mask  [b, n, w] int64   ancestor bitmask (plugins/bitmask.py), self included
    scale      float             softmax scale
    out        [b, n, h, d_v]    written: softmax(q k^T * scale) v, values = first d_v dims of each row
    lse        [b, n, h] fp32    written: natural-log sum of exp of the scaled, visible scores

Node i of request r attends to all committed rows of r and to the tree rows its mask allows.
Scores and softmax are fp32 whatever the input dtype.
"""

from __future__ import annotations

import torch

from plugins.bitmask import unpack_mask


def tree_verify_mla_reference(q: torch.Tensor, cache: torch.Tensor, cache_lens: torch.Tensor, tree_kv: torch.Tensor,
                              tree_mask: torch.Tensor, scale: float, out: torch.Tensor, lse: torch.Tensor) -> None:
    b, n, h, d_qk = q.shape
    l_max, d_v = cache.shape[1], out.shape[-1]
    qf = q.float()
    s_cache = torch.einsum("bnhc,blc->bnhl", qf, cache.float()) * scale  # [b, n, h, l_max]
    s_tree = torch.einsum("bnhc,bmc->bnhm", qf, tree_kv.float()) * scale  # [b, n, h, n]
    cache_ok = torch.arange(l_max, device=q.device)[None, :] < cache_lens[:, None].long()  # [b, l_max]
    tree_ok = unpack_mask(tree_mask, n)  # [b, n, n]
    s_cache = s_cache.masked_fill(~cache_ok[:, None, None, :], float("-inf"))
    s_tree = s_tree.masked_fill(~tree_ok[:, :, None, :], float("-inf"))
    s = torch.cat([s_cache, s_tree], dim=-1)  # [b, n, h, l_max + n]
    lse_val = torch.logsumexp(s, dim=-1)  # [b, n, h]
    p = torch.exp(s - lse_val[..., None])
    values = torch.cat([cache[..., :d_v], tree_kv[..., :d_v]], dim=1).float()  # [b, l_max + n, d_v]
    out.copy_(torch.einsum("bnhl,blc->bnhc", p, values))
    lse.copy_(lse_val)
