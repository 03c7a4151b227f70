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
from plugins.drafter_attention import drafter_attention
from plugins.layer_fusion import add_rms_norm, drafter_block, kv_norm_rope_store
from runtime.model.layers import linear, rms_norm, swiglu_mlp
from runtime.model.rope import Rope
from runtime.model.target import TargetModel


@dataclass
class DrafterLayerWeights:
    attn_norm: torch.Tensor  # [H]
    o: torch.Tensor  # [H, h_l*e]
    q_norm: torch.Tensor  # [e]
    mlp_norm: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2*i_l, H]
    down: torch.Tensor  # [H, i_l]


@dataclass
class DrafterWeights:
    fc: torch.Tensor  # [H, F_l]
    hidden_norm: torch.Tensor  # [H]
    layers: list[DrafterLayerWeights]
    norm: torch.Tensor  # [H]
    # every layer's q | k | v rows, stacked: layer li's block projections are qkv[li] (one GEMM), the context's K/V
    # of all layers qkv[:, h_l*e:] (one batched GEMM: the context is the same for every layer)
    qkv: torch.Tensor  # [layers, (h_l + 2*g_l)*e, H]
    k_norms: torch.Tensor  # [layers, e] every layer's k norm (one store kernel for all layers)
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
        feats = ctx_feats[..., self.feat_cols].to(self.target.dtype)  # [b, a, F_l]
        ctx = rms_norm(self._reduce(linear(feats, w.fc)), w.hidden_norm, c.rms_norm_eps)  # [b, a, H]
        ctx_pos, blk_pos = ctx_feats.new_empty(b, a, dtype=torch.long), ctx_feats.new_empty(b, s, dtype=torch.long)
        block, visible = ctx_feats.new_empty(b, s, dtype=torch.long), ctx_feats.new_empty(b, dtype=torch.long)
        # ctx_pos = lens + [0, a), blk_pos = start + [0, s) with start = lens + ctx_len, block = [bonus, mask x D],
        # visible = start + s (the cache rows the block attends: the context, then the block); lens += ctx_len
        drafter_block(cache.lens, ctx_len, bonus, self.mask_token_id, ctx_pos, blk_pos, block, visible)
        layers = w.layers
        if layers:  # the target's embedding (vocab-parallel under TP), the first norm and the block's rope
            x, xn, cos_b, sin_b = self.target.embed_norm_rope(block, layers[0].attn_norm, c.rms_norm_eps, blk_pos,
                                                              self.rope)  # [b, s, H] x2, [b, s, e/2] x2
        else:
            x = xn = self.target.embed(block)  # [b, s, H]
        cos_c, sin_c = self.rope.cos_sin(ctx_pos, x.dtype)  # [b, a, e/2]
        hq = self.heads * c.head_dim  # the q rows of qkv
        if layers:  # every layer's context rows at [lens, lens + a): one GEMM, one kernel (the context is shared)
            # rows past ctx_len land at [start, ...), which each layer's block overwrites below
            kv = torch.matmul(ctx.reshape(b * a, -1), w.qkv[:, hq:].transpose(1, 2))  # [layers, b*a, 2*g_l*e]
            self._store_kv(kv.transpose(0, 1), w.k_norms, cos_c, sin_c, ctx_pos, cache.k, cache.v)
        for li, lw in enumerate(layers):
            qkv = linear(xn, w.qkv[li]).view(b * s, -1)  # [b*s, (h_l + 2*g_l)*e]
            # the block's own rows: scratch past the committed length, the next call's context overwrites them;
            # its queries normed and roped in the same kernel
            q = self._store_kv(qkv[:, None, hq:], w.k_norms[li:li + 1], cos_b, sin_b, blk_pos, cache.k[li:li + 1],
                               cache.v[li:li + 1], qkv[:, :hq], lw.q_norm).view(b, s, self.heads, c.head_dim)
            attn = drafter_attention(q, cache.k[li], cache.v[li], visible, c.head_dim ** -0.5)  # [b, s, h_l*e]
            x, hn = add_rms_norm(x, self._reduce(linear(attn, lw.o)), lw.mlp_norm, c.rms_norm_eps)  # residual, norm
            nxt = layers[li + 1].attn_norm if li + 1 < len(layers) else w.norm  # the next norm (the final one last)
            x, xn = add_rms_norm(x, self._reduce(swiglu_mlp(hn, lw.gate_up, lw.down)), nxt, c.rms_norm_eps)
        y = xn[:, 1:] if layers else rms_norm(x[:, 1:], w.norm, c.rms_norm_eps)  # [b, D, H] (norms are per row)
        return self.target.logits(y)

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum a sharded drafter's partial results over the group (a replicated one has none)."""
        return partial if self.shards == 1 else self.target.comm.all_reduce(partial)

    def _store_kv(self, kv: torch.Tensor, k_norms: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q: torch.Tensor | None = None,
                  q_norm: torch.Tensor | None = None) -> torch.Tensor | None:
        """The projected K/V of L layers for the b * n rows at positions pos [b, n]: kv [b*n, L, 2*g_l*e] (per layer
        k | v; unit stride along the last dim), k_norms [L, e], into k_cache / v_cache [L, b, cap, g_l, e] (rows
        min(pos, cap - 1)): k normed per head and roped, v as projected.  With q [b*n, h_l*e] and q_norm [e]:
        returns the queries normed and roped, [b*n, h_l, e].  One kernel on CUDA."""
        c = self.cfg
        b, n = pos.shape
        kv = kv.view(b * n, k_norms.shape[0], 2, self.kv_heads, c.head_dim)  # [b*n, L, 2, g_l, e]
        qh = None if q is None else q.view(b * n, self.heads, c.head_dim)  # [b*n, h_l, e]
        return kv_norm_rope_store(kv, k_norms, c.rms_norm_eps, cos.reshape(b * n, -1), sin.reshape(b * n, -1),
                                  self.rope.interleave, pos, k_cache, v_cache, qh, q_norm)
