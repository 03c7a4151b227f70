"""The DFlash block-diffusion drafter (z-lab's model), batched, over its own context KV cache.

Letters: b requests, a context rows this round, s block slots (block_size), D = s - 1 draft depths,
H drafter hidden, h / g query / kv heads, e head_dim, F = len(target_layer_ids) * target hidden,
i MLP width; a suffix _l is this rank's share (h_l = h / shards, ...).

Under TP the drafter is either replicated (shards = 1: every rank runs all of it) or sharded like the
target (shards = tp, runtime/load/drafter.py cuts it): each rank holds h/tp query and g/tp kv heads,
o's matching columns, i/tp of the MLP and F/tp of fc's input columns, so fc, o and the MLP give
partial sums, one all-reduce each.  At K2.6 size the replicated drafter reads ~7 GB per round on
every rank, more than the target's AR step (DESIGN.md); sharded, 1/tp of it.

One call per round: the target features of the tokens committed last round (the context) are
projected by fc + hidden_norm and appended, as K/V, to every layer's context cache; the block
[bonus, mask x D] attends non-causally to the whole context cache and to itself; slot t of the
block (t >= 1) gives the draft distribution of the token at position start + t, through the
target's lm_head.  The block's K/V are written past the committed length, at [start, start + s),
as scratch the next call's context rows overwrite: the committed cache is still exactly positions
[0, start) after the call, and attention reads K/V in place (no concatenated or repeated copy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.drafter_config import DrafterConfig
from plugins.layer_fusion import add_rms_norm
from runtime.model.layers import bmm_acc, linear, rms_norm, swiglu_mlp
from runtime.model.rope import Rope
from runtime.model.target import TargetModel


@dataclass
class DrafterLayerWeights:
    attn_norm: torch.Tensor  # [H]
    q: torch.Tensor  # [h_l*e, H]
    kv: torch.Tensor  # [2*g_l*e, H]  k rows | v rows
    o: torch.Tensor  # [H, h_l*e]
    q_norm: torch.Tensor  # [e]
    k_norm: torch.Tensor  # [e]
    mlp_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2*i_l, H]
    down: torch.Tensor  # [H, i_l]


@dataclass
class DrafterWeights:
    fc: torch.Tensor  # [H, F_l]
    hidden_norm: torch.Tensor  # [H]
    layers: list[DrafterLayerWeights]
    norm: torch.Tensor  # [H]
    shards: int = 1  # 1: whole (replicated on every rank); tp: this rank's cut of heads, MLP and fc input


@dataclass
class DrafterCache:
    k: torch.Tensor  # [layers, b, capacity, g_l, e] roped keys of committed context rows
    v: torch.Tensor  # [layers, b, capacity, g_l, e]
    lens: torch.Tensor  # [b] int32 committed context rows (== the target's committed length)


class DFlashDrafter:
    """Drafter interface used by the speculative loop: block_size, mask_token_id, new_cache, draft."""

    def __init__(self, cfg: DrafterConfig, weights: DrafterWeights, target: TargetModel):
        self.cfg, self.w, self.target = cfg, weights, target
        self.block_size, self.mask_token_id = cfg.block_size, cfg.mask_token_id
        self.rope = Rope(cfg.rope, cfg.head_dim, interleave=False, device=target.device)
        self.shards = weights.shards
        if self.shards > 1 and (target.comm is None or target.comm.world != self.shards):
            raise ValueError(f"drafter cut for {self.shards} ranks, the target's group has "
                             f"{target.comm.world if target.comm else 1}")
        self.heads, self.kv_heads = cfg.num_heads // self.shards, cfg.num_kv_heads // self.shards  # h_l, g_l
        rank = target.comm.rank if target.comm is not None and self.shards > 1 else 0
        f_l = weights.fc.shape[1]
        self.feat_cols = slice(rank * f_l, (rank + 1) * f_l)  # this rank's columns of the features

    def cache_bytes(self, batch: int, capacity: int) -> int:
        """Bytes new_cache(batch, capacity) allocates (runtime/decode/memory.py sizes sessions with it)."""
        c = self.cfg
        return 2 * c.num_layers * batch * capacity * self.kv_heads * c.head_dim * self.w.fc.element_size()

    def new_cache(self, batch: int, capacity: int) -> DrafterCache:
        c = self.cfg
        shape = (c.num_layers, batch, capacity, self.kv_heads, c.head_dim)
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
        feats = ctx_feats[..., self.feat_cols].to(self.target.dtype)  # [b, a, F_l]
        ctx = rms_norm(self._reduce(linear(feats, w.fc)), w.hidden_norm, c.rms_norm_eps)  # [b, a, H]
        ctx_pos = cache.lens[:, None].long() + torch.arange(a, device=dev)  # [b, a]
        start = cache.lens.long() + ctx_len.long()  # [b]
        blk_pos = start[:, None] + torch.arange(s, device=dev)  # [b, s]
        block = torch.full((b, s), self.mask_token_id, dtype=torch.long, device=dev)
        block[:, 0] = bonus
        x = self.target.embed(block)  # [b, s, H] (the target's embedding: vocab-parallel under TP)
        cos_c, sin_c = self.rope.cos_sin(ctx_pos, x.dtype)
        cos_b, sin_b = self.rope.cos_sin(blk_pos, x.dtype)
        cap = cache.k.shape[2]
        rows = torch.arange(b, device=dev)[:, None]  # [b, 1]
        write = ctx_pos.clamp(max=cap - 1)  # rows past ctx_len land at [start, ...): the block overwrites them
        write_blk = blk_pos.clamp(max=cap - 1)  # the block's own rows, past the committed length
        hidden = torch.arange(cap, device=dev)[None, :] >= (start + s)[:, None]  # [b, cap] past context + block
        layers = w.layers
        xn = rms_norm(x, layers[0].attn_norm, c.rms_norm_eps) if layers else x  # [b, s, H]
        for li, lw in enumerate(layers):
            k_ctx, v_ctx = self._kv(lw, ctx, cos_c, sin_c)  # [b, a, g_l, e]
            cache.k[li, rows, write] = k_ctx
            cache.v[li, rows, write] = v_ctx
            q = self.rope.apply_normed(linear(xn, lw.q).view(b, s, self.heads, c.head_dim), lw.q_norm,
                                       c.rms_norm_eps, cos_b, sin_b)  # [b, s, h_l, e]
            k_blk, v_blk = self._kv(lw, xn, cos_b, sin_b)  # [b, s, g_l, e]
            cache.k[li, rows, write_blk] = k_blk  # scratch rows: the next call's context overwrites them
            cache.v[li, rows, write_blk] = v_blk
            attn = self._attend(q, cache.k[li], cache.v[li], hidden)  # [b, s, h_l*e]
            x, hn = add_rms_norm(x, self._reduce(linear(attn, lw.o)), lw.mlp_norm, c.rms_norm_eps)  # residual, norm
            nxt = layers[li + 1].attn_norm if li + 1 < len(layers) else w.norm  # the next norm (the final one last)
            x, xn = add_rms_norm(x, self._reduce(swiglu_mlp(hn, lw.gate_up, lw.down)), nxt, c.rms_norm_eps)
        cache.lens += ctx_len
        y = xn[:, 1:] if layers else rms_norm(x[:, 1:], w.norm, c.rms_norm_eps)  # [b, D, H] (norms are per row)
        return self.target.logits(y)

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum a sharded drafter's partial results over the group (a replicated one has none)."""
        return partial if self.shards == 1 else self.target.comm.all_reduce(partial)

    def _kv(self, lw: DrafterLayerWeights, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        b, n, _ = x.shape
        k, v = linear(x, lw.kv).view(b, n, 2, self.kv_heads, c.head_dim).unbind(2)
        return self.rope.apply_normed(k, lw.k_norm, c.rms_norm_eps, cos, sin), v

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, hidden: torch.Tensor
                ) -> torch.Tensor:
        """GQA without a causal mask: q [b, s, h_l, e] over the cache rows not hidden [b, cap] (visible: the
        context and, written just before, the block).  Each kv head's rep = h_l / g_l query heads are
        folded into its s queries, so K/V are never repeated or concatenated, and the two products are
        plain GEMMs over the cache rows (parallel over them: a fused attention kernel gets one block
        for these few queries and walks 32K rows alone).  Both GEMMs read the cache as stored (with b = 1 the
        [g_l, cap, e] operands are strided views: no copy) and accumulate in fp32 (runtime/model/layers.bmm_acc);
        scores and softmax in fp32, the probabilities rounded to the cache dtype for the second product (as
        flash attention rounds them)."""
        b, s, h, e = q.shape
        g, rep = self.kv_heads, h // self.kv_heads
        cap = k_cache.shape[1]
        qg = q.view(b, s, g, rep, e).permute(0, 2, 3, 1, 4).reshape(b * g, rep * s, e)  # [b*g_l, rep*s, e]
        k = k_cache.transpose(1, 2).reshape(b * g, cap, e)  # [b*g_l, cap, e]
        v = v_cache.transpose(1, 2).reshape(b * g, cap, e)
        scores = bmm_acc(qg, k.transpose(1, 2)).view(b, g, rep * s, cap) * e ** -0.5  # [b, g_l, rep*s, cap] fp32
        p = scores.masked_fill(hidden[:, None, None, :], float("-inf")).softmax(-1)
        out = bmm_acc(p.view(b * g, rep * s, cap).to(v.dtype), v).to(q.dtype)  # [b*g_l, rep*s, e]
        return out.view(b, g, rep, s, e).permute(0, 3, 1, 2, 4).reshape(b, s, h * e)
