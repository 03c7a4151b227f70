"""Prefill: a prompt through TargetModel.forward + kv_commit in chunks, each chunk a chain committed whole.

Every decode loop (AR and speculative) starts with it (runtime/decode/session.py); the server's slots
(runtime/decode/slots.py) run the same chunks one at a time, between rounds.
"""

from __future__ import annotations

import torch

from plugins.common.bitmask import causal_mask
from plugins.kv_commit import kv_commit
from runtime.model.cache import LatentCache
from runtime.model.target import TargetModel


def commit_chain(cache: LatentCache, n: int) -> None:
    """Append all n scratch rows (a chain) of request 0.. to the committed cache."""
    b = cache.lens.shape[0]
    idx = torch.arange(n, dtype=torch.int32, device=cache.lens.device).expand(b, n).contiguous()
    kv_commit(cache.kv, cache.lens, cache.scratch, idx, torch.full((b,), n, dtype=torch.int32, device=idx.device))


def prefill(model: TargetModel, cache: LatentCache, prompt: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """prompt [p] int64 for request 0 of a batch-1 cache -> (last hidden [d], features [p, f*d] or None)."""
    chunk = cache.tokens_per_forward
    p = prompt.shape[0]
    if p == 0:
        raise ValueError("prompt is empty: give at least one token")
    if p + 1 > cache.capacity:
        raise ValueError(f"prompt of {p} tokens does not fit the cache capacity {cache.capacity}")
    feats = []
    hidden = None
    for start in range(0, p, chunk):
        hidden, f = prefill_chunk(model, cache, prompt[start:start + chunk])
        if f is not None:
            feats.append(f)
    return hidden[-1], (torch.cat(feats) if feats else None)


def prefill_chunk(model: TargetModel, cache: LatentCache, ids: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ids [n] int64 (n <= cache.tokens_per_forward): the next n prompt tokens of request 0 of a batch-1
    cache, after its committed rows, as one chain committed whole -> (hidden [n, d], features [n, f*d] or
    None).  A prompt prefilled chunk by chunk this way equals prefill() over the same chunks."""
    n = ids.shape[0]
    positions = cache.lens[:, None].long() + torch.arange(n, device=ids.device)  # [1, n]
    hidden, f = model.forward(ids[None], positions, cache, causal_mask(1, n, ids.device))  # [1, n, d], [1, n, F]
    commit_chain(cache, n)
    return hidden[0], (f[0] if f is not None else None)


def prefill_requests(model: TargetModel, cache: LatentCache, prompts: list[list[int]]
                     ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Prefill request r of a batch cache with prompts[r] -> (last hidden [b, d], features [p_r, f] per request)."""
    last, feats = [], []
    for r, prompt in enumerate(prompts):
        view = cache.request(r)
        h, f = prefill(model, view, torch.tensor(prompt, dtype=torch.long, device=model.device))
        last.append(h)
        feats.append(f)
    return torch.stack(last), feats
