"""moe_w4a16: the routed-expert block of Kimi K2.x (routing + expert FFNs); see reference.py.

`torch.ops.kdtree.moe_w4a16` is one name on both devices: on CPU it is the reference (route_reference +
experts_reference, INT4 experts dequantised exactly first), on CUDA a kernel path (no host sync, capturable in
a CUDA graph).  INT4 experts come in one of two layouts, told apart by their rank:
  planar (layout.py; w13 [e_l, 2i, kp/8], 3-D): the Triton path of launch.py (v2c);
  fragment order (fragment_layout.py; w13 [e_l, 2i/32, kp/32, 32, 4], 5-D): v3, launch_v3.py (CUDA C GEMMs),
    for bf16 tokens and scales; other dtypes run v2c on a planar copy made per call.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from plugins.common.activation import silu_mul_reference
from plugins.common.op import kdtree_op
from plugins.common.precision import acc, acc_dtype
from plugins.moe_w4a16.fragment_layout import dequantize_fragments, from_fragments, to_fragments
from plugins.moe_w4a16.layout import dequantize_kernel_layout, pack_experts
from plugins.moe_w4a16.plan import launch_plan
from plugins.moe_w4a16.reference import experts_reference, route_reference, shared_down_reference
from plugins.moe_w4a16.workspace import MoEWorkspace

__all__ = ["moe_w4a16", "moe_w4a16_op", "MoEWorkspace", "route_reference", "experts_reference", "dense_experts",
           "pack_int4_experts", "expert_dims", "dequantize_experts"]


def pack_int4_experts(w13_q: torch.Tensor, w13_s: torch.Tensor, w2_q: torch.Tensor, w2_s: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The build's one repacking of INT4 experts: int8 values w13 [e, 2i, d] (gate rows | up rows), w2 [e, d, i]
    in [-8, 7] and their group-32 scales [..., k/32] -> (w13, w13_scale, w2, w2_scale) in fragment order
    (fragment_layout.py).  Group 32 makes d and i multiples of 32, so the rows always come in whole pairs;
    artifacts built before fragment order hold the planar layout (layout.py), which the op still reads."""
    return (*to_fragments(w13_q, w13_s, True), *to_fragments(w2_q, w2_s, False))


def dense_experts(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor | None, w2: torch.Tensor,
                  w2_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts as dense [e, 2i, d] / [e, d, i] in x's dtype (INT4 kernel layout dequantised exactly)."""
    if w13_scale is None:
        return w13.to(x.dtype), w2.to(x.dtype)
    w13f, w2f = dequantize_experts(w13, w13_scale, w2, w2_scale, x.shape[-1])
    return w13f.to(x.dtype), w2f.to(x.dtype)


def dequantize_experts(w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                       d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact fp32 experts w13 [e_l, 2i, d], w2 [e_l, d, i] from INT4 in either kernel layout (fragment order,
    5-D, or planar, 3-D); d: the hidden size (the true k of w13)."""
    i = expert_dims(w13)[1]
    if w13.dim() == 5:
        return dequantize_fragments(w13, w13_scale, d, True), dequantize_fragments(w2, w2_scale, i, False)
    return dequantize_kernel_layout(w13, w13_scale, d), dequantize_kernel_layout(w2, w2_scale, i)


def expert_dims(w13: torch.Tensor) -> tuple[int, int]:
    """(e_local, i) of w13 in any of its forms: dense or planar [e_l, 2i, .], fragment [e_l, 2i/32, ...]."""
    return w13.shape[0], (w13.shape[1] * 32 if w13.dim() == 5 else w13.shape[1]) // 2


def planar_copy(w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, d: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fragment-order experts -> the planar layout (exact), for the v2c path."""
    return (*pack_experts(*from_fragments(w13, s13, d, True)),
            *pack_experts(*from_fragments(w2, s2, expert_dims(w13)[1], False)))


def v3_multiplies(dtype: torch.dtype, scale_dtype: torch.dtype) -> bool:
    """Whether launch_v3 serves fragment-order experts for tokens of `dtype` and scales of `scale_dtype` (its
    mma multiplies bf16; other dtypes run v2c on a planar copy).  Shapes are launch_v3.check_fragments's."""
    return dtype == torch.bfloat16 and scale_dtype == torch.bfloat16


def _logits(x: torch.Tensor, logits: torch.Tensor | None, gate: torch.Tensor | None) -> torch.Tensor:
    if logits is not None:
        return logits
    if gate is None:
        raise ValueError("moe_w4a16: give the router logits or the gate weights")
    return F.linear(acc(x), gate.to(acc_dtype(x.dtype)))  # [t, e] fp32 (fp64 in fp64 runs)


def moe_w4a16(x: torch.Tensor, logits: torch.Tensor | None, gate: torch.Tensor | None, bias: torch.Tensor,
              w13: torch.Tensor, w13_scale: torch.Tensor | None, w2: torch.Tensor, w2_scale: torch.Tensor | None,
              top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool, scaling: float,
              e_start: int = 0, workspace: Optional[torch.Tensor] = None,
              shared_gate_up: Optional[torch.Tensor] = None, shared_h: Optional[torch.Tensor] = None,
              shared_down: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Routed experts of one MoE layer, x [t, d] -> y [t, d], through the registered op (see moe_w4a16_op);
    workspace: a MoEWorkspace's .buffer, or None."""
    # every argument passed explicitly: torch 2.11's mutation bookkeeping indexes the given args only
    return moe_w4a16_op(x, logits, gate, bias, w13, w13_scale, w2, w2_scale, top_k, n_group, topk_group,
                        norm_topk_prob, scaling, e_start, workspace, shared_gate_up, shared_h, shared_down)


@kdtree_op("moe_w4a16", mutates_args=("workspace", "shared_h"))
def moe_w4a16_op(x: torch.Tensor, logits: Optional[torch.Tensor], gate: Optional[torch.Tensor], bias: torch.Tensor,
                 w13: torch.Tensor, w13_scale: Optional[torch.Tensor], w2: torch.Tensor,
                 w2_scale: Optional[torch.Tensor], top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool,
                 scaling: float, e_start: int, workspace: Optional[torch.Tensor],
                 shared_gate_up: Optional[torch.Tensor] = None, shared_h: Optional[torch.Tensor] = None,
                 shared_down: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Routed experts of one MoE layer: x [t, d] -> y [t, d] (x's dtype), the shared expert excluded.

    logits [t, e] fp32 router logits, or None with gate [e, d] (logits = x @ gate^T in fp32);
    bias [e] e_score_correction_bias.  Experts: INT4 in the kernel layout of
    plugins/moe_w4a16/layout.py (w13 int32 [e_l, 2i, kp_d/8], w13_scale [e_l, kp_d/32, 2i],
    w2 int32 [e_l, d, kp_i/8], w2_scale [e_l, kp_i/32, d]) or dense (scales None: w13 [e_l, 2i, d],
    w2 [e_l, d, i]).  The e_l experts held are [e_start, e_start + e_l); slots routed elsewhere add nothing.

    workspace: uint8 [nbytes], MoEWorkspace.allocate(max_tokens, top_k, e_l, d, i, x.dtype, device).buffer
    with t <= max_tokens, so the kernel path allocates only y; None allocates the scratch per call.  The CPU
    path (the reference) checks its size and does not use it.

    shared_gate_up [t, 2i'] (the shared expert's gate | up columns, e.g. of the router's fp32 GEMM; unit stride
    along 2i') with shared_h [t, i'] (x's dtype, unit stride along i'): also writes shared_h = silu(gate) * up
    rounded as plugins/common/activation.py (on CUDA inside the routing kernel: no launch of its own).
    shared_down [d, i'] (x's dtype, contiguous; with shared_h): y also gets the shared expert's output,
    shared_h . shared_down^T accumulated into the routed sum as a GEMM with beta = 1
    (reference.shared_down_reference; on CUDA inside the combine kernel: no GEMM launch of its own).
    """
    _check_shared(x, shared_gate_up, shared_h, shared_down)
    if shared_h is not None:
        shared_h.copy_(silu_mul_reference(shared_gate_up, x.dtype))
    if workspace is not None:  # the kernel path's capacity check
        t, d = x.shape
        e_local, i = expert_dims(w13)
        MoEWorkspace.carve(workspace, t, top_k, e_local, d, i, x.dtype,
                           launch_plan(t, top_k, e_local, d, i, x.device).splits)
    topk_idx, topk_w = route_reference(_logits(x, logits, gate), bias, top_k, n_group, topk_group,
                                       norm_topk_prob, scaling)
    w13d, w2d = dense_experts(x, w13, w13_scale, w2, w2_scale)
    y = experts_reference(x, topk_idx, topk_w, w13d, w2d, e_start)
    return y if shared_down is None else shared_down_reference(y, shared_h, shared_down)


@moe_w4a16_op.register_fake
def _(x, logits, gate, bias, w13, w13_scale, w2, w2_scale, top_k, n_group, topk_group, norm_topk_prob, scaling,
      e_start, workspace, shared_gate_up=None, shared_h=None, shared_down=None):
    return torch.empty_like(x)


@moe_w4a16_op.register_kernel("cuda")
def _(x, logits, gate, bias, w13, w13_scale, w2, w2_scale, top_k, n_group, topk_group, norm_topk_prob, scaling,
      e_start, workspace, shared_gate_up=None, shared_h=None, shared_down=None):
    _check_shared(x, shared_gate_up, shared_h, shared_down)
    lg = _logits(x, logits, gate).float()
    shared = (shared_gate_up, shared_h, shared_down)
    if w13.dim() == 5:
        if v3_multiplies(x.dtype, w13_scale.dtype):
            from plugins.moe_w4a16.launch_v3 import moe_w4a16_v3
            return moe_w4a16_v3(x, lg, bias, w13, w13_scale, w2, w2_scale, top_k, n_group, topk_group,
                                norm_topk_prob, scaling, e_start, workspace, *shared)
        w13, w13_scale, w2, w2_scale = planar_copy(w13, w13_scale, w2, w2_scale, x.shape[-1])
    from plugins.moe_w4a16.launch import moe_w4a16_triton
    return moe_w4a16_triton(x, lg, bias, w13, w13_scale, w2, w2_scale, top_k, n_group, topk_group,
                            norm_topk_prob, scaling, e_start, workspace, shared_gate_up=shared_gate_up,
                            shared_h=shared_h, shared_down=shared_down)


def _check_shared(x: torch.Tensor, gate_up: Optional[torch.Tensor], h: Optional[torch.Tensor],
                  down: Optional[torch.Tensor] = None) -> None:
    """shared_gate_up [t, 2i'] and shared_h [t, i'] come together, on x's device, with unit stride along the row;
    shared_down [d, i'] (x's dtype, contiguous) only with them."""
    if gate_up is None and h is None:
        if down is not None:
            raise ValueError("moe_w4a16: shared_down needs shared_gate_up and shared_h (the shared expert's "
                             "activation the routing kernel forms)")
        return
    t = x.shape[0]
    if gate_up is None or h is None:
        raise ValueError("moe_w4a16: shared_gate_up and shared_h come together (the shared expert's activation)")
    i = h.shape[-1] if h.dim() == 2 else -1
    if gate_up.dim() != 2 or tuple(gate_up.shape) != (t, 2 * i) or gate_up.stride(1) != 1 \
            or not gate_up.dtype.is_floating_point or gate_up.device != x.device:
        raise ValueError(f"moe_w4a16: shared_gate_up must be floating [{t}, 2 * i'] with unit stride along its "
                         f"row, on {x.device}, got {gate_up.dtype} {tuple(gate_up.shape)} {gate_up.stride()} on "
                         f"{gate_up.device}")
    if h.dim() != 2 or h.shape[0] != t or h.dtype != x.dtype or h.stride(1) != 1 or h.device != x.device:
        raise ValueError(f"moe_w4a16: shared_h must be {x.dtype} [{t}, i'] with unit stride along its row, on "
                         f"{x.device}, got {h.dtype} {tuple(h.shape)} {h.stride()} on {h.device}")
    if down is not None and (tuple(down.shape) != (x.shape[1], i) or down.dtype != x.dtype
                             or not down.is_contiguous() or down.device != x.device):
        raise ValueError(f"moe_w4a16: shared_down must be contiguous {x.dtype} [{x.shape[1]}, {i}] on {x.device}, "
                         f"got {down.dtype} {tuple(down.shape)} on {down.device}")
