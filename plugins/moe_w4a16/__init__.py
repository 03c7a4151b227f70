"""moe_w4a16: the routed-expert block of Kimi K2.x (routing + expert FFNs); see reference.py.

`torch.ops.kdtree.moe_w4a16` is one name on both devices: on CPU it is the reference (route_reference +
experts_reference, INT4 experts dequantised exactly first), on CUDA the Triton path of launch.py
(routing, grouping, gate/up, down, combine; no host sync, capturable in a CUDA graph).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plugins.moe_w4a16.reference import experts_reference, route_reference
from plugins.precision import acc

__all__ = ["moe_w4a16", "route_reference", "experts_reference", "dense_experts"]


def dense_experts(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor | None, w2: torch.Tensor,
                  w2_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts as dense [e, 2i, d] / [e, d, i] in x's dtype (INT4 kernel layout dequantised exactly)."""
    if w13_scale is None:
        return w13.to(x.dtype), w2.to(x.dtype)
    from build_pipeline.moe_layout import dequantize_kernel_layout
    d, i = x.shape[-1], w13.shape[1] // 2
    return (dequantize_kernel_layout(w13, w13_scale, d).to(x.dtype),
            dequantize_kernel_layout(w2, w2_scale, i).to(x.dtype))


def _logits(x: torch.Tensor, logits: torch.Tensor | None, gate: torch.Tensor | None) -> torch.Tensor:
    if logits is not None:
        return logits
    if gate is None:
        raise ValueError("moe_w4a16: give the router logits or the gate weights")
    return F.linear(acc(x), gate.to(acc(x).dtype))  # [t, e] fp32 (fp64 in fp64 runs)


@torch.library.custom_op("kdtree::moe_w4a16", mutates_args=())
def moe_w4a16(x: torch.Tensor, logits: torch.Tensor | None, gate: torch.Tensor | None, bias: torch.Tensor,
              w13: torch.Tensor, w13_scale: torch.Tensor | None, w2: torch.Tensor, w2_scale: torch.Tensor | None,
              top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool, scaling: float,
              e_start: int = 0) -> torch.Tensor:
    """Routed experts of one MoE layer: x [t, d] -> y [t, d] (x's dtype), the shared expert excluded.

    logits [t, e] fp32 router logits, or None with gate [e, d] (logits = x @ gate^T in fp32);
    bias [e] e_score_correction_bias.  Experts: INT4 in the kernel layout of
    build_pipeline/moe_layout.py (w13 int32 [e_l, 2i, kp_d/8], w13_scale [e_l, kp_d/32, 2i],
    w2 int32 [e_l, d, kp_i/8], w2_scale [e_l, kp_i/32, d]) or dense (scales None: w13 [e_l, 2i, d],
    w2 [e_l, d, i]).  The e_l experts held are [e_start, e_start + e_l); slots routed elsewhere add nothing.
    """
    topk_idx, topk_w = route_reference(_logits(x, logits, gate), bias, top_k, n_group, topk_group,
                                       norm_topk_prob, scaling)
    w13d, w2d = dense_experts(x, w13, w13_scale, w2, w2_scale)
    return experts_reference(x, topk_idx, topk_w, w13d, w2d, e_start)


@moe_w4a16.register_fake
def _(x, logits, gate, bias, w13, w13_scale, w2, w2_scale, top_k, n_group, topk_group, norm_topk_prob, scaling,
      e_start=0):
    return torch.empty_like(x)


@moe_w4a16.register_kernel("cuda")
def _(x, logits, gate, bias, w13, w13_scale, w2, w2_scale, top_k, n_group, topk_group, norm_topk_prob, scaling,
      e_start=0):
    from plugins.moe_w4a16.launch import moe_w4a16_triton
    lg = _logits(x, logits, gate).float()
    return moe_w4a16_triton(x, lg, bias, w13, w13_scale, w2, w2_scale, top_k, n_group, topk_group,
                            norm_topk_prob, scaling, e_start)
