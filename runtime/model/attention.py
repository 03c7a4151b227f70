"""Multi-head latent attention (MLA) in the weight-absorbed form, over the latent cache.

Letters: b requests, n tokens, h heads, d hidden, p qk_nope dims, r rope dims, c latent (kv_lora_rank),
u v_head_dim.  Absorbed: q_lat = q_nope . W_UK (p -> c), scores = [q_lat | q_pe] . [c_kv | k_pe],
values = c_kv, out_h = (attn . c_kv) . W_UV (c -> u), then o_proj.  The attention itself is the
kdtree::tree_verify_mla op, so the same code serves prefill chunks, AR steps and tree verification.

Tensor parallel: `w` holds this rank's h/tp heads (q_b / kv_b rows and o_proj columns cut by head,
q_a / kv_a replicated, core/plan.py), so h below is the local head count, every rank
computes and caches the same full latent row, and the result is this rank's partial sum of o_proj:
the caller (runtime/model/target.py) all-reduces it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from core.config import ModelConfig
from plugins.tree_verify_mla import tree_verify_mla
from runtime.model.layers import rms_norm
from runtime.model.rope import Rope
from runtime.model.weights import AttentionWeights
from runtime.model.workspace import ForwardWorkspace


def mla_forward(cfg: ModelConfig, w: AttentionWeights, rope: Rope, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, kv: torch.Tensor, lens: torch.Tensor, scratch: torch.Tensor,
                tree_mask: torch.Tensor, ws: ForwardWorkspace) -> torch.Tensor:
    """x [b, n, d] -> [b, n, d] (under TP this rank's partial sum over its heads).  Writes the n
    tokens' latent rows into scratch[:, :n] ([b, n_max, c+r]).

    kv [b, l_max, c+r] is this layer's committed cache, lens [b] its lengths, tree_mask [b, n, w]
    which of the n tokens each token sees (itself and its ancestors); ws holds the attention's outputs.
    """
    b, n, _ = x.shape
    h, p, r, c = w.w_uk.shape[0], cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    if w.q_a is not None:
        q = F.linear(rms_norm(F.linear(x, w.q_a), w.q_a_norm, cfg.rms_norm_eps), w.q_b)
    else:
        q = F.linear(x, w.q_b)
    q = q.view(b, n, h, p + r)
    q_nope, q_pe = q[..., :p], rope.apply(q[..., p:], cos, sin)  # [b, n, h, p], [b, n, h, r]
    q_lat = torch.einsum("bnhp,hpc->bnhc", q_nope, w.w_uk)  # [b, n, h, c]

    latent = F.linear(x, w.kv_a)  # [b, n, c+r]
    c_kv = rms_norm(latent[..., :c], w.kv_a_norm, cfg.rms_norm_eps)  # [b, n, c]
    k_pe = rope.apply(latent[..., c:], cos, sin)  # [b, n, r]
    tree_kv = scratch[:, :n]
    tree_kv.copy_(torch.cat([c_kv, k_pe], dim=-1))

    q_full = torch.cat([q_lat, q_pe], dim=-1).contiguous()  # [b, n, h, c+r]
    o_lat, lse = ws.attention(b, n, h, c)  # [b, n, h, c], [b, n, h]
    tree_verify_mla(q_full, kv, lens, tree_kv, tree_mask, cfg.softmax_scale, o_lat, lse)
    o = torch.einsum("bnhc,huc->bnhu", o_lat, w.w_uv)  # [b, n, h, u]
    return F.linear(o.reshape(b, n, -1), w.o)
