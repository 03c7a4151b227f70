"""Reference (torch) for kv_commit: append the accepted tree nodes' latent rows to the committed cache.

Shapes: y layers, b requests, l_max cache capacity, n tree nodes, a accept capacity, d_qk row width.

    cache       [y, b, l_max, d_qk]  committed latent cache of every layer (written)
    cache_lens  [b] int32            committed length per request (advanced by accept_len)
    scratch     [y, b, n, d_qk]      the tree nodes' latent rows from the verify pass
    accept_idx  [b, a] int32         accepted node indices in path order (root first); slots >= accept_len unused
    accept_len  [b] int32            accepted nodes per request (0 <= accept_len <= a)
    feats       [b, n, f] or None    the tree nodes' target features (drafter context), optional
    ctx_feats   [b, a, f] or None    written: ctx_feats[r, j] = feats[r, accept_idx[r, j]] for j < accept_len[r]

cache[:, r, cache_lens[r] + j] = scratch[:, r, accept_idx[r, j]] for j < accept_len[r], then
cache_lens[r] += accept_len[r] (unless advance is False: an AR step's round_emit advances it, one launch fewer).
The scratch is separate from the cache, so the copy never reads a
row it has already overwritten.
"""

from __future__ import annotations

import torch


def kv_commit_reference(cache: torch.Tensor, cache_lens: torch.Tensor, scratch: torch.Tensor,
                        accept_idx: torch.Tensor, accept_len: torch.Tensor, feats: torch.Tensor | None = None,
                        ctx_feats: torch.Tensor | None = None, advance: bool = True) -> None:
    b, a = accept_idx.shape
    j = torch.arange(a, device=cache.device)
    valid = j[None, :] < accept_len[:, None]  # [b, a]
    rows = torch.arange(b, device=cache.device)[:, None].expand(b, a)  # [b, a]
    dst = cache_lens[:, None].long() + j[None, :]  # [b, a]
    src = scratch[:, rows[valid], accept_idx.long()[valid]]  # [y, m, d_qk]
    cache[:, rows[valid], dst[valid]] = src
    if feats is not None and ctx_feats is not None:
        ctx_feats[valid] = feats[rows[valid], accept_idx.long()[valid]]
    if advance:
        cache_lens += accept_len
