"""The MoE block of a DeepSeek-V3 layer: sigmoid router with correction bias, routed experts, shared expert.

The routed part is one op, `kdtree::moe_w4a16` (plugins/moe_w4a16): the torch reference on CPU, the
Triton kernels on CUDA (reading the packed INT4 experts when the weights carry them, else the dense
ones).  The shared expert is a plain MLP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from build_pipeline.config import ModelConfig
from plugins.moe_w4a16 import moe_w4a16
from plugins.precision import acc
from runtime.layers import swiglu_mlp
from runtime.weights import MoEWeights


def moe_forward(cfg: ModelConfig, w: MoEWeights, x: torch.Tensor, e_start: int = 0) -> torch.Tensor:
    """x [b, n, d] -> [b, n, d]: routed experts (weighted, scaled) plus the shared expert.

    Expert parallel: w holds the routed experts [e_start, e_start + e_local) only, and the result is
    this rank's partial sum (the caller all-reduces)."""
    shape = x.shape
    xt = x.reshape(-1, shape[-1])  # [t, d]
    logits = F.linear(acc(xt), w.gate.to(acc(xt).dtype))  # [t, e] fp32 (fp64 in fp64 runs)
    if xt.is_cuda and w.int4 is not None:
        q = w.int4
        w13, s13, w2, s2 = q.w13, q.w13_scale, q.w2, q.w2_scale
    else:
        w13, s13, w2, s2 = w.w13, None, w.w2, None
    y = moe_w4a16(xt, logits, None, w.gate_bias, w13, s13, w2, s2, cfg.num_experts_per_tok, cfg.n_group,
                  cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor, e_start)
    if w.shared is not None:
        y = y + swiglu_mlp(xt, w.shared.gate_up, w.shared.down)
    return y.view(shape)
