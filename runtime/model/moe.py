"""The MoE block of a DeepSeek-V3 layer: sigmoid router with correction bias, routed experts, shared expert.

The routed part is one op, `kdtree::moe_w4a16` (plugins/moe_w4a16): the torch reference on CPU
(INT4 experts dequantised per call), the Triton kernels on CUDA; both read the experts in the one
form the rank holds them (runtime/model/weights.Experts).  The shared expert is a plain MLP whose gate_up
shares the router's GEMM when the loader stacked the two (MoEWeights.router_inputs): one fp32-output GEMM
gives the router logits and the gate_up values, rounded to the model dtype before SiLU * up (what a separate
model-dtype GEMM would have returned); the routed op forms that activation in its routing kernel and adds the
shared down projection to the routed sum in its combine kernel (two launches fewer per layer).
"""

from __future__ import annotations

import torch

from core.config import ModelConfig
from plugins.common.precision import acc_dtype
from plugins.moe_w4a16 import moe_w4a16
from runtime.model.layers import linear, swiglu_mlp
from runtime.model.weights import MoEWeights


def router_logits(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x [t, d] @ gate [e, d]^T -> [t, e] in fp32 (fp64 in fp64 runs), the products of the stored values
    summed in fp32 as DeepSeek-V3's reference router does.  A bf16 gate (as checkpoints ship it) is read
    as bf16 on CUDA with an fp32 result straight from the fp32 accumulator (runtime/model/layers.linear:
    cuBLAS's aten::mm.dtype): half the bytes of an fp32 copy; elsewhere both sides are upcast (exact for
    bf16 values)."""
    return linear(x, gate, out_dtype=acc_dtype(x.dtype))


def moe_forward(cfg: ModelConfig, w: MoEWeights, x: torch.Tensor, e_start: int = 0,
                workspace: torch.Tensor | None = None) -> torch.Tensor:
    """x [b, n, d] -> [b, n, d]: routed experts (weighted, scaled) plus the shared expert.

    Expert parallel: w holds the routed experts [e_start, e_start + e_local) only, and the result is
    this rank's partial sum (the caller all-reduces).  workspace: the op's buffer for >= b*n tokens
    (runtime/model/workspace.py; None only outside a decode session, e.g. a test of this block)."""
    shape = x.shape
    xt = x.reshape(-1, shape[-1])  # [t, d]
    joint = w.router_inputs()  # [e+2i, d] or None
    gate_up = None
    if joint is not None:  # the router and the shared expert's gate_up in one GEMM, fp32 out
        e = w.gate.shape[0]
        both = router_logits(xt, joint)  # [t, e+2i] fp32 (fp64 in fp64 runs)
        logits, gate_up = both[:, :e], both[:, e:]  # [t, e] router logits, [t, 2i] fp32
    else:
        logits = router_logits(xt, w.gate)  # [t, e] fp32 (fp64 in fp64 runs)
    ex = w.experts
    # the shared expert's activation h [t, i'] from its gate_up columns, formed by the op's routing kernel, and its
    # down projection added to the routed sum by the op's combine kernel
    h = None if gate_up is None else xt.new_empty(xt.shape[0], gate_up.shape[1] // 2)
    down = None if h is None else w.shared.down  # [d, i']
    folded = down is not None and down.is_contiguous() and down.dtype == xt.dtype  # the op's combine adds it
    y = moe_w4a16(xt, logits, None, w.gate_bias, ex.w13, ex.w13_scale, ex.w2, ex.w2_scale, cfg.num_experts_per_tok,
                  cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor, e_start, workspace,
                  gate_up, h, down if folded else None)
    if h is not None and not folded:  # y + shared(x), the down projection accumulating into y (one GEMM)
        y = linear(h, down, c=y)
    elif h is None and w.shared is not None:
        y = swiglu_mlp(xt, w.shared.gate_up, w.shared.down, c=y)
    return y.view(shape)
