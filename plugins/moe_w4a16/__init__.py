"""moe_w4a16: the routed-expert block of Kimi K2.x (routing + expert FFNs); see reference.py.

`torch.ops.kdtree.moe_w4a16` is one name on both devices: on CPU it is the reference (route_reference +
experts_reference, INT4 experts dequantised exactly first), on CUDA the Triton path of launch.py
(routing, grouping, gate/up, down, combine; no host sync, capturable in a CUDA graph).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from plugins.common.op import kdtree_op
from plugins.common.precision import acc
from plugins.moe_w4a16.layout import dequantize_kernel_layout
from plugins.moe_w4a16.plan import launch_plan
from plugins.moe_w4a16.reference import experts_reference, route_reference
from plugins.moe_w4a16.workspace import MoEWorkspace

__all__ = ["moe_w4a16", "moe_w4a16_op", "MoEWorkspace", "route_reference", "experts_reference", "dense_experts"]


def dense_experts(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor | None, w2: torch.Tensor,
                  w2_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts as dense [e, 2i, d] / [e, d, i] in x's dtype (INT4 kernel layout dequantised exactly)."""
    if w13_scale is None:
        return w13.to(x.dtype), w2.to(x.dtype)
    d, i = x.shape[-1], w13.shape[1] // 2
    return (dequantize_kernel_layout(w13, w13_scale, d).to(x.dtype),
            dequantize_kernel_layout(w2, w2_scale, i).to(x.dtype))


def _logits(x: torch.Tensor, logits: torch.Tensor | None, gate: torch.Tensor | None) -> torch.Tensor:
    if logits is not None:
        return logits
    if gate is None:
        raise ValueError("moe_w4a16: give the router logits or the gate weights")
    return F.linear(acc(x), gate.to(acc(x).dtype))  # [t, e] fp32 (fp64 in fp64 runs)


def moe_w4a16(x: torch.Tensor, logits: torch.Tensor | None, gate: torch.Tensor | None, bias: torch.Tensor,
              w13: torch.Tensor, w13_scale: torch.Tensor | None, w2: torch.Tensor, w2_scale: torch.Tensor | None,
              top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool, scaling: float,
              e_start: int = 0, workspace: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Routed experts of one MoE layer, x [t, d] -> y [t, d], through the registered op (see moe_w4a16_op);
    workspace: a MoEWorkspace's .buffer, or None."""
    # every argument passed explicitly: torch 2.11's mutation bookkeeping indexes the given args only
    return moe_w4a16_op(x, logits, gate, bias, w13, w13_scale, w2, w2_scale, top_k, n_group, topk_group,
                        norm_topk_prob, scaling, e_start, workspace)


@kdtree_op("moe_w4a16", mutates_args=("workspace",))
def moe_w4a16_op(x: torch.Tensor, logits: Optional[torch.Tensor], gate: Optional[torch.Tensor], bias: torch.Tensor,
                 w13: torch.Tensor, w13_scale: Optional[torch.Tensor], w2: torch.Tensor,
                 w2_scale: Optional[torch.Tensor], top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool,
                 scaling: float, e_start: int, workspace: Optional[torch.Tensor]) -> torch.Tensor:
    """Routed experts of one MoE layer: x [t, d] -> y [t, d] (x's dtype), the shared expert excluded.

    logits [t, e] fp32 router logits, or None with gate [e, d] (logits = x @ gate^T in fp32);
    bias [e] e_score_correction_bias.  Experts: INT4 in the kernel layout of
    plugins/moe_w4a16/layout.py (w13 int32 [e_l, 2i, kp_d/8], w13_scale [e_l, kp_d/32, 2i],
    w2 int32 [e_l, d, kp_i/8], w2_scale [e_l, kp_i/32, d]) or dense (scales None: w13 [e_l, 2i, d],
    w2 [e_l, d, i]).  The e_l experts held are [e_start, e_start + e_l); slots routed elsewhere add nothing.

    workspace: uint8 [nbytes], MoEWorkspace.allocate(max_tokens, top_k, e_l, d, i, x.dtype, device).buffer
    with t <= max_tokens, so the kernel path allocates only y; None allocates the scratch per call.  The CPU
    path (the reference) checks its size and does not use it.
    """
    if workspace is not None:  # the kernel path's capacity check
        t, d = x.shape
        e_local, i = w13.shape[0], w13.shape[1] // 2
        MoEWorkspace.carve(workspace, t, top_k, e_local, d, i, x.dtype,
                           launch_plan(t, top_k, e_local, d, i, x.device).splits)
    topk_idx, topk_w = route_reference(_logits(x, logits, gate), bias, top_k, n_group, topk_group,
                                       norm_topk_prob, scaling)
    w13d, w2d = dense_experts(x, w13, w13_scale, w2, w2_scale)
    return experts_reference(x, topk_idx, topk_w, w13d, w2d, e_start)


@moe_w4a16_op.register_fake
def _(x, logits, gate, bias, w13, w13_scale, w2, w2_scale, top_k, n_group, topk_group, norm_topk_prob, scaling,
      e_start, workspace):
    return torch.empty_like(x)


@moe_w4a16_op.register_kernel("cuda")
def _(x, logits, gate, bias, w13, w13_scale, w2, w2_scale, top_k, n_group, topk_group, norm_topk_prob, scaling,
      e_start, workspace):
    from plugins.moe_w4a16.launch import moe_w4a16_triton
    lg = _logits(x, logits, gate).float()
    return moe_w4a16_triton(x, lg, bias, w13, w13_scale, w2, w2_scale, top_k, n_group, topk_group,
                            norm_topk_prob, scaling, e_start, workspace)
