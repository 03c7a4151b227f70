"""Test-only drafter that proposes the target's own greedy continuation, with controllable noise.

Same interface as runtime.model.drafter.DFlashDrafter (block_size, mask_token_id, new_cache, draft).  It
keeps its own copy of the target's latent cache, fed with the committed tokens it receives each
round (ctx_tokens), and greedily decodes D tokens after the bonus.  Draft logits put `margin` on
that greedy token at every depth, plus Gaussian noise; with probability `miss_prob` a random other
token is put one above it, so a chain misses while a tree can still catch it as a sibling.  At
miss_prob 0 every draft is right and tau reaches block_size.
"""

from __future__ import annotations

import torch

from plugins.common.bitmask import causal_mask
from plugins.kv_commit import kv_commit
from runtime.model.cache import LatentCache
from runtime.model.target import TargetModel


class AgreeingDrafter:
    def __init__(self, target: TargetModel, block_size: int = 8, miss_prob: float = 0.0, margin: float = 8.0,
                 noise: float = 1.0, seed: int = 0):
        self.target, self.block_size = target, block_size
        self.mask_token_id = target.cfg.vocab_size - 2
        self.miss_prob, self.margin, self.noise = miss_prob, margin, noise
        self.gen = torch.Generator().manual_seed(seed)

    def new_cache(self, batch: int, capacity: int) -> LatentCache:
        """Its own copy of the target's latent cache (scratch wide enough for a whole prompt)."""
        return self.target.new_cache(batch, capacity, capacity)

    def draft(self, cache: LatentCache, ctx_feats, ctx_len: torch.Tensor, bonus: torch.Tensor,
              ctx_tokens: torch.Tensor) -> torch.Tensor:
        b = bonus.shape[0]
        depth, vocab = self.block_size - 1, self.target.cfg.vocab_size
        width = max(int(ctx_len.max()), 1)
        self._append(cache, ctx_tokens[:, :width], ctx_len)  # commit the new context tokens
        saved = cache.lens.clone()
        greedy = torch.empty(b, depth, dtype=torch.long)
        tok = bonus[:, None]  # [b, 1]
        one = torch.ones(b, dtype=torch.int32)
        for d in range(depth):  # the target's greedy continuation after the bonus, then roll back
            h = self._append(cache, tok, one)
            tok = self.target.logits(h).argmax(-1)[:, None]
            greedy[:, d] = tok[:, 0]
        cache.lens.copy_(saved)
        logits = self.noise * torch.randn(b, depth, vocab, generator=self.gen)
        logits.scatter_add_(2, greedy[..., None], torch.full((b, depth, 1), self.margin))
        miss = torch.rand(b, depth, generator=self.gen) < self.miss_prob
        other = (greedy + 1 + torch.randint(vocab - 1, (b, depth), generator=self.gen)) % vocab
        top = logits.gather(2, greedy[..., None])[..., 0] + 1.0
        logits.scatter_(2, other[..., None],
                        torch.where(miss, top, logits.gather(2, other[..., None])[..., 0])[..., None])
        return logits.to(bonus.device)

    def _append(self, cache: LatentCache, ids: torch.Tensor, n_valid: torch.Tensor) -> torch.Tensor:
        """Feed ids [b, m] as chains, commit the first n_valid[r] of each; returns hidden [b, d] of the
        last valid token of each request."""
        b, m = ids.shape
        pos = cache.lens[:, None].long() + torch.arange(m, device=ids.device)
        hidden, _ = self.target.forward(ids, pos, cache, causal_mask(b, m, ids.device))
        idx = torch.arange(m, dtype=torch.int32).expand(b, m).contiguous()
        kv_commit(cache.kv, cache.lens, cache.scratch, idx, n_valid.to(torch.int32))
        return hidden[torch.arange(b), (n_valid.long() - 1).clamp(min=0)]
