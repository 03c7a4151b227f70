"""Multi-head latent attention (MLA) in the weight-absorbed form, over the latent cache.

Letters: b requests, n tokens, h heads, d hidden, p qk_nope dims, r rope dims, c latent (kv_lora_rank),
u v_head_dim.  Absorbed: q_lat = q_nope . W_UK (p -> c), scores = [q_lat | q_pe] . [c_kv | k_pe],
values = c_kv, out_h = (attn . c_kv) . W_UV (c -> u), then o_proj.  Both absorptions are batched
GEMMs over heads reading their operands through strides; rope, the latent row's norm and the
query's assembly are the fused kernels of plugins/layer_fusion.  The attention itself is the
kdtree::tree_verify_mla op, so the same code serves prefill chunks, AR steps and tree verification.

Tensor parallel: `w` holds this rank's h/tp heads (q_b / kv_b rows and o_proj columns cut by head,
q_a / kv_a replicated, core/plan.py), so h below is the local head count, every rank
computes and caches the same full latent row, and the result is this rank's partial sum of o_proj:
the caller (runtime/model/target.py) all-reduces it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from core.config import ModelConfig
from core.env_flags import env_flag
from plugins.l2_prefetch import l2_prefetch
from plugins.layer_fusion import mla_q_absorb, mla_rope_kv, mla_v_absorb
from plugins.tree_verify_mla import tree_verify_mla
from runtime.model.layers import linear
from runtime.model.rope import Rope
from runtime.model.weights import AttentionWeights
from runtime.model.workspace import ForwardWorkspace

# KDTREE_GEMM_PREFETCH=1: the L2 prefetch of the layer's post-attention weights (off until measured on the GPU:
# benchmarks/l2_prefetch.py, then the rank benchmark with and without it)
GEMM_PREFETCH = env_flag("KDTREE_GEMM_PREFETCH", False)


def mla_forward(cfg: ModelConfig, w: AttentionWeights, rope: Rope, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, kv: torch.Tensor, lens: torch.Tensor, scratch: torch.Tensor,
                tree_mask: torch.Tensor, ws: ForwardWorkspace, prefetch: Sequence[torch.Tensor] = ()
                ) -> torch.Tensor:
    """x [b, n, d] -> [b, n, d] (under TP this rank's partial sum over its heads).  Writes the n
    tokens' latent rows into scratch[:, :n] ([b, n_max, c+r]).

    kv [b, l_max, c+r] is this layer's committed cache, lens [b] its lengths, tree_mask [b, n, w]
    which of the n tokens each token sees (itself and its ancestors); ws holds the attention's outputs.
    With GEMM_PREFETCH on CUDA, o_proj's and W_UV's weights and up to two of `prefetch` (the caller's next GEMMs')
    are put in flight into L2 before the attention, which leaves HBM mostly idle.
    """
    b, n, _ = x.shape
    t = b * n
    h, p, r, c = w.w_uk.shape[0], cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    u = w.w_uv.shape[1]
    xt = x.reshape(t, -1)  # [t, d]
    joint = w.latent_inputs()  # [q+c+r, d] or None
    if joint is not None:  # q_a and kv_a in one GEMM
        both = linear(xt, joint)  # [t, q+c+r]
        q_low, latent = both[:, :w.q_a.shape[0]], both[:, w.q_a.shape[0]:]  # [t, q], [t, c+r]
    else:
        q_low, latent = (linear(xt, w.q_a) if w.q_a is not None else None), linear(xt, w.kv_a)
    cos_t, sin_t = cos.reshape(t, -1), sin.reshape(t, -1)  # [t, r/2]
    tree_kv = scratch[:, :n]  # [b, n, c+r]: [rms_norm(c_kv) | rope(k_pe)] written in place
    # both latent rows' norms in one kernel: the kv row into tree_kv, the query's low-rank row into q_n
    q_n = None if q_low is None else torch.empty(q_low.shape, dtype=q_low.dtype, device=q_low.device)  # [t, q]
    mla_rope_kv(latent, w.kv_a_norm, cfg.rms_norm_eps, cos_t, sin_t, rope.interleave, tree_kv,
                q_low, w.q_a_norm if q_low is not None else None, q_n)
    q = linear(q_n if q_n is not None else xt, w.q_b).view(t, h, p + r)  # [t, h, p+r]
    q_full = mla_q_absorb(q, w.w_uk, cos_t, sin_t, rope.interleave).view(b, n, h, c + r)  # [q_nope . W_UK | rope]

    if GEMM_PREFETCH and x.is_cuda:  # a hint (plugins/l2_prefetch): the weights of the GEMMs after the attention
        l2_prefetch([t for t in (w.o, w.w_uv, *prefetch) if t is not None and t.is_contiguous()][:4])
    o_lat, lse = ws.attention(b, n, h, c)  # [b, n, h, c], [b, n, h]
    tree_verify_mla(q_full, kv, lens, tree_kv, tree_mask, cfg.softmax_scale, o_lat, lse)
    o = mla_v_absorb(o_lat.view(t, h, c), w.w_uv)  # [t, h, u] = o_lat . W_UV^T per head: o_proj's input rows
    return linear(o.view(b, n, h * u), w.o)
