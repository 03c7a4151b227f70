"""The DFlash block-diffusion drafter (z-lab's model), batched, over its own context KV cache.

Letters: b requests, a context rows this round, s block slots (block_size), D = s - 1 draft depths,
H drafter hidden, h / g query / kv heads, e head_dim, F = len(target_layer_ids) * target hidden.

One call per round: the target features of the tokens committed last round (the context) are
projected by fc + hidden_norm and appended, as K/V, to every layer's context cache; the block
[bonus, mask x D] attends non-causally to the whole context cache and to itself; slot t of the
block (t >= 1) gives the draft distribution of the token at position start + t, through the
target's lm_head.  Block rows are never cached, so the cache always holds exactly the committed
positions [0, start).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from core.drafter_config import DrafterConfig
from plugins.common.precision import acc
from runtime.model.layers import rms_norm, swiglu_mlp
from runtime.model.rope import Rope
from runtime.model.target import TargetModel


@dataclass
class DrafterLayerWeights:
    attn_norm: torch.Tensor  # [H]
    q: torch.Tensor  # [h*e, H]
    kv: torch.Tensor  # [2*g*e, H]  k rows | v rows
    o: torch.Tensor  # [H, h*e]
    q_norm: torch.Tensor  # [e]
    k_norm: torch.Tensor  # [e]
    mlp_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2i, H]
    down: torch.Tensor  # [H, i]


@dataclass
class DrafterWeights:
    fc: torch.Tensor  # [H, F]
    hidden_norm: torch.Tensor  # [H]
    layers: list[DrafterLayerWeights]
    norm: torch.Tensor  # [H]


@dataclass
class DrafterCache:
    k: torch.Tensor  # [layers, b, capacity, g, e] roped keys of committed context rows
    v: torch.Tensor  # [layers, b, capacity, g, e]
    lens: torch.Tensor  # [b] int32 committed context rows (== the target's committed length)


class DFlashDrafter:
    """Drafter interface used by the speculative loop: block_size, mask_token_id, new_cache, draft."""

    def __init__(self, cfg: DrafterConfig, weights: DrafterWeights, target: TargetModel):
        self.cfg, self.w, self.target = cfg, weights, target
        self.block_size, self.mask_token_id = cfg.block_size, cfg.mask_token_id
        self.rope = Rope(cfg.rope, cfg.head_dim, interleave=False, device=target.device)

    def new_cache(self, batch: int, capacity: int) -> DrafterCache:
        c = self.cfg
        shape = (c.num_layers, batch, capacity, c.num_kv_heads, c.head_dim)
        dev, dt = self.target.device, self.target.dtype
        return DrafterCache(torch.zeros(shape, dtype=dt, device=dev), torch.zeros(shape, dtype=dt, device=dev),
                            torch.zeros(batch, dtype=torch.int32, device=dev))

    def draft(self, cache: DrafterCache, ctx_feats: torch.Tensor, ctx_len: torch.Tensor, bonus: torch.Tensor,
              ctx_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """ctx_feats [b, a, F] target features of the context rows (the first ctx_len[r] are real),
        ctx_len [b] int32, bonus [b] int64 -> draft logits [b, D, V] fp32 for positions start+1..start+D,
        where start = cache.lens + ctx_len.  Advances cache.lens by ctx_len.  (ctx_tokens unused:
        the interface carries them for drafters that work from tokens.)"""
        c, w = self.cfg, self.w
        b, a, _ = ctx_feats.shape
        s = c.block_size
        dev = ctx_feats.device
        ctx = rms_norm(F.linear(ctx_feats.to(self.target.dtype), w.fc), w.hidden_norm, c.rms_norm_eps)  # [b, a, H]
        ctx_pos = cache.lens[:, None].long() + torch.arange(a, device=dev)  # [b, a]
        start = cache.lens.long() + ctx_len.long()  # [b]
        blk_pos = start[:, None] + torch.arange(s, device=dev)  # [b, s]
        block = torch.full((b, s), self.mask_token_id, dtype=torch.long, device=dev)
        block[:, 0] = bonus
        x = self.target.embed(block)  # [b, s, H] (the target's embedding: vocab-parallel under TP)
        cos_c, sin_c = self.rope.cos_sin(ctx_pos, x.dtype)
        cos_b, sin_b = self.rope.cos_sin(blk_pos, x.dtype)
        cap = cache.k.shape[2]
        rows = torch.arange(b, device=dev)[:, None].expand(b, a)
        write = ctx_pos.clamp(max=cap - 1)  # rows past ctx_len land beyond the new length: ignored
        visible = torch.arange(cap, device=dev)[None, :] < start[:, None]  # [b, cap]
        for li, lw in enumerate(w.layers):
            k_ctx, v_ctx = self._kv(lw, ctx, cos_c, sin_c)  # [b, a, g, e]
            cache.k[li, rows, write] = k_ctx
            cache.v[li, rows, write] = v_ctx
            xn = rms_norm(x, lw.attn_norm, c.rms_norm_eps)
            q = self.rope.apply(rms_norm(F.linear(xn, lw.q).view(b, s, c.num_heads, c.head_dim), lw.q_norm,
                                         c.rms_norm_eps), cos_b, sin_b)  # [b, s, h, e]
            k_blk, v_blk = self._kv(lw, xn, cos_b, sin_b)  # [b, s, g, e]
            attn = self._attend(q, cache.k[li], cache.v[li], visible, k_blk, v_blk)  # [b, s, h*e]
            x = x + F.linear(attn, lw.o)
            x = x + swiglu_mlp(rms_norm(x, lw.mlp_norm, c.rms_norm_eps), lw.gate_up, lw.down)
        cache.lens += ctx_len
        y = rms_norm(x[:, 1:], w.norm, c.rms_norm_eps)  # [b, D, H]
        return self.target.logits(y)

    def _kv(self, lw: DrafterLayerWeights, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        b, n, _ = x.shape
        k, v = F.linear(x, lw.kv).view(b, n, 2, c.num_kv_heads, c.head_dim).unbind(2)
        return self.rope.apply(rms_norm(k, lw.k_norm, c.rms_norm_eps), cos, sin), v

    def _attend(self, q, k_cache, v_cache, visible, k_blk, v_blk) -> torch.Tensor:
        """GQA without a causal mask: q [b, s, h, e] over cached rows (where visible) and all block rows."""
        c = self.cfg
        b, s, h, e = q.shape
        rep = c.num_heads // c.num_kv_heads
        k = torch.cat([k_cache, k_blk], dim=1).repeat_interleave(rep, dim=2)  # [b, cap+s, h, e]
        v = torch.cat([v_cache, v_blk], dim=1).repeat_interleave(rep, dim=2)
        scores = torch.einsum("bshe,bkhe->bhsk", acc(q), acc(k)) * e ** -0.5  # [b, h, s, cap+s]
        ok = torch.cat([visible, torch.ones(b, s, dtype=torch.bool, device=q.device)], dim=1)  # [b, cap+s]
        scores = scores.masked_fill(~ok[:, None, None, :], float("-inf"))
        out = torch.einsum("bhsk,bkhe->bshe", scores.softmax(-1), acc(v)).to(q.dtype)
        return out.reshape(b, s, h * e)

