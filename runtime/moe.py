"""The MoE block of a DeepSeek-V3 layer: sigmoid router with correction bias, routed experts, shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from build_pipeline.config import ModelConfig
from plugins.precision import acc
from plugins.moe_w4a16 import experts_reference, route_reference
from runtime.layers import swiglu_mlp
from runtime.weights import MoEWeights


def moe_forward(cfg: ModelConfig, w: MoEWeights, x: torch.Tensor) -> torch.Tensor:
    """x [b, n, d] -> [b, n, d]: routed experts (weighted, scaled) plus the shared expert."""
    shape = x.shape
    xt = x.reshape(-1, shape[-1])  # [t, d]
    logits = F.linear(acc(xt), w.gate.to(acc(xt).dtype))  # [t, e] fp32 (fp64 in fp64 runs)
    topk_idx, topk_w = route_reference(logits, w.gate_bias, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                                       cfg.norm_topk_prob, cfg.routed_scaling_factor)
    y = experts_reference(xt, topk_idx, topk_w, w.w13, w.w2)
    if w.shared is not None:
        y = y + swiglu_mlp(xt, w.shared.gate_up, w.shared.down)
    return y.view(shape)
