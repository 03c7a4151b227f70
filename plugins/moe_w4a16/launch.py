"""Launcher of the Triton moe_w4a16 path: entry checks, the workspace's views, six launches, no host sync.

route_kernel (top-k + bucket by expert) -> gate_up_kernel (split-K partials) ->
silu_mul_kernel (h = silu(gate) * up) -> down_kernel -> combine_kernel.
Every size is a function of the static shapes (t, K, e_local, d, i) and the device's SM count (plan.py); the
data-dependent parts (how many experts are active, how many tokens each has) are read on the device.  The
scratch comes from a caller's MoEWorkspace buffer (workspace.py) or, without one, from one allocation per
call; the output y is allocated per call (the op returns it).  Runs on CUDA tensors and, under
TRITON_INTERPRET=1, on CPU tensors (the CPU tests check the kernel logic that way).
"""

from __future__ import annotations

import os

import torch

from plugins.common.pdl import pdl_args, pdl_for
from plugins.moe_w4a16.expert_kernels import (
    combine_kernel,
    combine_shared_kernel,
    down_kernel,
    gate_up_kernel,
    silu_mul_kernel,
)
from plugins.moe_w4a16.layout import BLOCK_K, GROUP
from plugins.moe_w4a16.plan import KernelConfig, cdiv, expert_programs, launch_plan
from plugins.moe_w4a16.route_kernel import launch_route, next_pow2
from plugins.moe_w4a16.workspace import MoEWorkspace


def _check(x, logits, bias, w13, s13, w2, s2, top_k, n_group, topk_group, e_start) -> tuple[int, int, int, bool]:
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"moe_w4a16: x must be [t, d] bf16/fp16/fp32, got {tuple(x.shape)} {x.dtype}")
    t, d = x.shape
    if logits.dim() != 2 or logits.shape[0] != t or logits.dtype != torch.float32:
        raise ValueError(f"moe_w4a16: logits must be fp32 [{t}, e], got {tuple(logits.shape)} {logits.dtype}")
    e = logits.shape[1]
    if bias.shape != (e,):
        raise ValueError(f"moe_w4a16: bias must be [{e}], got {tuple(bias.shape)}")
    if not 1 <= top_k <= e or n_group < 1 or e % n_group or (n_group > 1 and (e // n_group < 2
                                                                                  or not 1 <= topk_group <= n_group)):
        raise ValueError(f"moe_w4a16: bad routing (e {e}, top_k {top_k}, n_group {n_group}, topk_group {topk_group})")
    int4 = s13 is not None
    if int4 != (s2 is not None):
        raise ValueError("moe_w4a16: give both scales (INT4 experts) or neither (dense experts)")
    e_local, two_i = w13.shape[0], w13.shape[1]
    i = two_i // 2
    if int4:
        kp1, kp2 = -(-d // BLOCK_K) * BLOCK_K, -(-i // BLOCK_K) * BLOCK_K
        want = {"w13": (w13, (e_local, 2 * i, kp1 // 8), torch.int32),
                "w2": (w2, (e_local, d, kp2 // 8), torch.int32),
                "w13_scale": (s13, (e_local, kp1 // GROUP, 2 * i), None),
                "w2_scale": (s2, (e_local, kp2 // GROUP, d), None)}
    else:
        want = {"w13": (w13, (e_local, 2 * i, d), x.dtype), "w2": (w2, (e_local, d, i), x.dtype)}
    for name, (ten, shape, dtype) in want.items():
        packed = dtype is not None  # weights: contiguous; scales: any strides (indexed [e, g, n])
        if tuple(ten.shape) != shape or (packed and ten.dtype != dtype) or (packed and not ten.is_contiguous()):
            raise ValueError(f"moe_w4a16: {name} must be {'contiguous ' if packed else ''}{dtype or 'float'} "
                             f"{list(shape)}, got {ten.dtype} {list(ten.shape)}")
    if not 0 <= e_start <= e - e_local:
        raise ValueError(f"moe_w4a16: local experts [{e_start}, {e_start + e_local}) outside [0, {e})")
    return e, e_local, i, int4


def moe_w4a16_triton(x: torch.Tensor, logits: torch.Tensor, bias: torch.Tensor, w13: torch.Tensor,
                     w13_scale: torch.Tensor | None, w2: torch.Tensor, w2_scale: torch.Tensor | None,
                     top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool, scaling: float,
                     e_start: int = 0, workspace: torch.Tensor | None = None,
                     config: KernelConfig | None = None, shared_gate_up: torch.Tensor | None = None,
                     shared_h: torch.Tensor | None = None, shared_down: torch.Tensor | None = None) -> torch.Tensor:
    """Routed experts of one MoE layer: x [t, d], logits [t, e] fp32 -> y [t, d] (x's dtype).

    INT4 experts in the kernel layout (plugins/moe_w4a16/layout.py): w13 int32 [e_local, 2i, kp_d/8],
    w13_scale [e_local, kp_d/32, 2i], w2 int32 [e_local, d, kp_i/8], w2_scale [e_local, kp_i/32, d];
    or dense experts (scales None): w13 [e_local, 2i, d], w2 [e_local, d, i] in x's dtype.
    Only experts [e_start, e_start + e_local) are held; other slots add nothing.
    workspace: a MoEWorkspace's .buffer (uint8) for at least this call (allocated with the same config);
    None allocates the scratch here.  shared_gate_up [t, 2i'] / shared_h [t, i']: the routing kernel also
    writes the shared expert's silu(gate) * up (route_kernel.launch_route); with shared_down [d, i'] the combine
    adds shared_h . shared_down^T to y (launch_combine).
    """
    x = x.contiguous()
    logits = logits if logits.dim() == 2 and logits.stride(1) == 1 else logits.contiguous()  # rows may be strided
    e, e_local, i, int4 = _check(x, logits, bias, w13, w13_scale, w2, w2_scale, top_k, n_group, topk_group, e_start)
    t, d = x.shape
    y = torch.empty_like(x)
    if t == 0:
        return y
    plan = launch_plan(t, top_k, e_local, d, i, x.device, config)
    cfg = plan.cfg
    if workspace is None:
        workspace = torch.zeros(MoEWorkspace.nbytes(t, top_k, e_local, d, i, x.dtype, x.device, config),
                                dtype=torch.uint8, device=x.device)  # zero counts (workspace.py)
    elif workspace.device != x.device:
        raise ValueError(f"moe_w4a16: workspace is on {workspace.device}, x on {x.device}")
    ws = MoEWorkspace.carve(workspace, t, top_k, e_local, d, i, x.dtype, plan.splits)
    counts, active, lists, topk_idx, topk_w = ws.counts, ws.active, ws.lists, ws.topk_idx, ws.topk_w
    # counts [e_local + 1] is zero here (MoEWorkspace.allocate zeroes it, every call's combine re-zeroes it)

    launch_route(logits, bias, topk_idx, topk_w, counts, active, lists, e_start, e_local, scaling, top_k, n_group,
                 topk_group, norm_topk_prob, shared_gate_up, shared_h)

    interp = os.environ.get("TRITON_INTERPRET") == "1"
    prec = "interp" if interp else "ieee" if x.dtype == torch.float32 else "tf32"
    # two weights per instruction: bf16 tokens and scales, PTX (not the interpreter), per-plane scale loads
    paired = (cfg.packed and int4 and not interp and not cfg.scale_tile and x.dtype == torch.bfloat16
              and w13_scale.dtype == w2_scale.dtype == torch.bfloat16)
    slots = min(e_local, t * top_k)
    n_slots = t * top_k
    s13 = w13_scale if int4 else w13  # any tensor: unused when dense
    s2 = w2_scale if int4 else w2
    splits, mt = plan.splits, plan.mt
    rows1, rows2 = cdiv(2 * i, cfg.bn1), cdiv(d, cfg.bn2)  # row blocks per expert
    gate_up_kernel[(expert_programs(slots, rows1 * splits * mt, plan.sms, cfg.grid_e), rows1, splits * mt)](
        x, w13, s13, ws.part, counts, active, lists, t, d, 2 * i, e_local, n_slots,
        w13.stride(0), w13.stride(1), *_scale_strides(s13, int4),
        TOPK=top_k, INT4=int4, N_KB=plan.n_kb1, KB_PER=plan.kb_per, MT=mt, BN=cfg.bn1, BM=cfg.bm, PACKED=paired,
        SCALE_TILE=cfg.scale_tile, DOT_PREC=prec, num_warps=cfg.warps1, num_stages=cfg.stages1)
    bi = min(cfg.bi, next_pow2(i))
    silu_mul_kernel[(n_slots, cdiv(i, bi))](ws.part, ws.h, topk_idx, i, n_slots, e_start, e_local,
                                            SPLITS=splits, BI=bi, num_warps=4)
    down_kernel[(expert_programs(slots, rows2 * mt, plan.sms, cfg.grid_e), rows2, mt)](
        ws.h, w2, s2, topk_w, ws.out, counts, active, lists, t, d, i, e_local,
        w2.stride(0), w2.stride(1), *_scale_strides(s2, int4),
        INT4=int4, N_KB=plan.n_kb2, BN=cfg.bn2, BM=cfg.bm, PACKED=paired, SCALE_TILE=cfg.scale_tile, DOT_PREC=prec,
        num_warps=cfg.warps2, num_stages=cfg.stages2)
    launch_combine(ws.out, topk_idx, y, counts, e_start, e_local, top_k, pdl_for(x), shared_h, shared_down, cfg.bd)
    return y


def launch_combine(out: torch.Tensor, topk_idx: torch.Tensor, y: torch.Tensor, counts: torch.Tensor, e_start: int,
                   e_local: int, top_k: int, pdl: bool, shared_h: torch.Tensor | None = None,
                   shared_down: torch.Tensor | None = None, bd: int = 1024, early: bool = False,
                   shared_f: torch.Tensor | None = None) -> None:
    """The op's last launch: y [t, d] = the sum of each token's local slots of out [t * top_k, d] (and, with
    shared_down [d, i'], + shared_h [t, i'] . shared_down^T in the same kernel); re-zeroes counts for the next call.
    bd: columns per program of the plain combine.  early (with shared_down): the shared product before the
    PDL wait (combine_shared_kernel's EARLY).  shared_f [t, d] fp32 (instead of shared_h / shared_down): that
    product, formed by the previous kernel (moe_v3.cu's kdtree_moe_v3_one), added the same way."""
    t, d = y.shape
    if shared_f is not None:
        bd = min(256, next_pow2(d))  # loads only: more programs, fewer loads each (d / 256 = 28 at K2.6)
        combine_shared_kernel[(t, cdiv(d, bd))](
            out, topk_idx, y, counts, shared_f, shared_f, t, d, 0, shared_f.stride(0), e_start, e_local, K=top_k,
            BT=1, BD=bd, BI=16, N_KI=1, BC=next_pow2(e_local + 1), DOT_PREC="ieee", num_warps=4, SHARED_F=True,
            **pdl_args(pdl))
        return
    if shared_down is None:
        bd = min(bd, next_pow2(d))
        combine_kernel[(t, cdiv(d, bd))](out, topk_idx, y, counts, d, e_start, e_local, K=top_k, BD=bd,
                                         BC=next_pow2(e_local + 1), num_warps=4, **pdl_args(pdl))
        return
    i = shared_down.shape[1]
    bt = 16 if t <= 16 else 32 if t <= 32 else 64  # token rows per program (tl.dot's M >= 16)
    bd, bi = 64, min(128, max(16, next_pow2(i)))  # 64 columns: d / 64 programs stream the [d, i'] weight once
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    prec = "interp" if interp else "ieee" if y.dtype == torch.float32 else "tf32"
    combine_shared_kernel[(cdiv(t, bt), cdiv(d, bd))](
        out, topk_idx, y, counts, shared_h, shared_down, t, d, i, shared_h.stride(0), e_start, e_local, K=top_k,
        BT=bt, BD=bd, BI=bi, N_KI=cdiv(i, bi), BC=next_pow2(e_local + 1), DOT_PREC=prec, num_warps=4,
        EARLY=early, **pdl_args(pdl))


def _scale_strides(s: torch.Tensor, int4: bool) -> tuple[int, int, int]:
    """(expert, row, group) strides of a scale tensor indexed [e, g, n] (any memory order); zeros when dense."""
    return (s.stride(0), s.stride(2), s.stride(1)) if int4 else (0, 0, 0)
