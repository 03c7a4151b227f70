"""Launcher of the Triton moe_w4a16 path: entry checks, static workspaces, six launches, no host sync.

memset(counts) -> route_kernel (top-k + bucket by expert) -> gate_up_kernel (split-K partials) ->
silu_mul_kernel (h = silu(gate) * up) -> down_kernel -> combine_kernel.
Every size is a function of the static shapes (t, K, e_local, d, i); the data-dependent parts (how
many experts are active, how many tokens each has) are read on the device.  Runs on CUDA tensors and,
under TRITON_INTERPRET=1, on CPU tensors (the CPU tests check the kernel logic that way).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from build_pipeline.moe_layout import BLOCK_K, GROUP
from plugins.moe_w4a16.expert_kernels import combine_kernel, down_kernel, gate_up_kernel, silu_mul_kernel
from plugins.moe_w4a16.route_kernel import next_pow2, route_kernel

SMS = 132  # H200; only used to pick tile sizes that give enough programs
PROGRAMS_PER_SM = 16  # grid size the expert loops aim at: a few waves of programs, few of them idle


@dataclass(frozen=True)
class KernelConfig:
    """Tiles: bm tokens per tile; bn1 rows of w13 (of 2i) per gate_up program, bn2 rows of w2 (of d) per down
    program; split: k splits of gate_up; mt: token tiles in the grid; grid_e: programs per row block that loop
    over the active experts.  0 in bm, split, mt or grid_e: chosen from the shapes (launch_plan, expert_programs)."""
    bm: int = 0
    bn1: int = 64
    bn2: int = 128
    split: int = 0
    mt: int = 0
    grid_e: int = 0
    packed: bool = True  # dequantise two weights per instruction where eligible (bf16 tokens and scales, GPU)
    scale_tile: bool = False
    warps1: int = 4
    warps2: int = 4
    stages1: int = 3
    stages2: int = 3
    bi: int = 1024  # silu_mul: features of h per program
    bd: int = 1024  # combine: features per program


@dataclass(frozen=True)
class LaunchPlan:
    """The static launch sizes of one call, from the shapes alone: the tiles, the 256-wide k blocks of each GEMM
    (n_kb1 over d, n_kb2 over i), gate_up's k blocks per split and split count, and the token tiles in the
    grid (mt).  Kernel variants are keyed by these (tests/test_moe_w4a16.py groups its compile warm-up by them)."""
    cfg: KernelConfig
    n_kb1: int
    n_kb2: int
    kb_per: int
    splits: int
    mt: int


def launch_plan(t: int, top_k: int, e_local: int, d: int, i: int, config: KernelConfig | None = None) -> LaunchPlan:
    """config (default KernelConfig()) with its 0 fields chosen from the static shapes, from the H200 tile
    sweep (NOTES.md): bm 16 up to 128 token slots (t * top_k), 32 above (64 past 48 slots per local expert);
    the k split of gate_up so that (experts likely active) x (row blocks) x splits fills the SMs about four
    times over (tree routing touches about half the slots' worth of distinct experts)."""
    cfg = config or KernelConfig()
    n_slots = t * top_k
    bm = cfg.bm or (16 if n_slots <= 128 else 32 if n_slots <= 48 * e_local else 64)
    n_kb1, n_kb2 = triton_cdiv(d, BLOCK_K), triton_cdiv(i, BLOCK_K)
    blocks = max(1, min(e_local, n_slots) // 2) * triton_cdiv(2 * i, cfg.bn1)
    split = cfg.split or max(1, min(triton_cdiv(4 * SMS, blocks), n_kb1))
    kb_per = triton_cdiv(n_kb1, min(split, n_kb1))
    cfg = replace(cfg, bm=bm, split=split, mt=cfg.mt or min(triton_cdiv(t, bm), 4))
    return LaunchPlan(cfg, n_kb1, n_kb2, kb_per, triton_cdiv(n_kb1, kb_per), cfg.mt)


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
                     e_start: int = 0, config: KernelConfig | None = None) -> torch.Tensor:
    """Routed experts of one MoE layer: x [t, d], logits [t, e] fp32 -> y [t, d] (x's dtype).

    INT4 experts in the kernel layout (build_pipeline/moe_layout.py): w13 int32 [e_local, 2i, kp_d/8],
    w13_scale [e_local, kp_d/32, 2i], w2 int32 [e_local, d, kp_i/8], w2_scale [e_local, kp_i/32, d];
    or dense experts (scales None): w13 [e_local, 2i, d], w2 [e_local, d, i] in x's dtype.
    Only experts [e_start, e_start + e_local) are held; other slots add nothing.
    """
    x, logits = x.contiguous(), logits.contiguous()
    e, e_local, i, int4 = _check(x, logits, bias, w13, w13_scale, w2, w2_scale, top_k, n_group, topk_group, e_start)
    t, d = x.shape
    y = torch.empty_like(x)
    if t == 0:
        return y
    plan = launch_plan(t, top_k, e_local, d, i, config)
    cfg = plan.cfg
    dev = x.device
    counts = torch.zeros(e_local + 1, dtype=torch.int32, device=dev)  # [e_local] tokens per expert | n_active
    active = torch.empty(e_local, dtype=torch.int32, device=dev)  # local ids of the active experts
    lists = torch.empty(e_local * t, dtype=torch.int32, device=dev)  # [e_local, t] slot ids per expert
    topk_idx = torch.empty(t * top_k, dtype=torch.int32, device=dev)  # [t, K] global expert ids
    topk_w = torch.empty(t * top_k, dtype=torch.float32, device=dev)  # [t, K]
    out = torch.empty(t * top_k, d, dtype=x.dtype, device=dev)  # [t*K, d] weighted expert output per slot

    be = next_pow2(e)
    route_kernel[(t,)](  # one token per one-warp program: each pick is a warp-shuffle reduction
        logits, bias, topk_idx, topk_w, counts, active, lists, t, e, e_start, e_local, float(scaling),
        K=top_k, N_GROUP=n_group, TOPK_GROUP=topk_group, NORM=bool(norm_topk_prob),
        BT=1, BE=be, BKK=next_pow2(top_k), BG=next_pow2(n_group), num_warps=1)

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
    part = torch.empty(splits, n_slots, 2 * i, dtype=torch.float32, device=dev)  # [splits, t*K, 2i] gate|up partials
    rows1, rows2 = triton_cdiv(2 * i, cfg.bn1), triton_cdiv(d, cfg.bn2)  # row blocks per expert
    gate_up_kernel[(expert_programs(slots, rows1 * splits * mt, cfg.grid_e), rows1, splits * mt)](
        x, w13, s13, part, counts, active, lists, t, d, 2 * i, e_local, n_slots,
        w13.stride(0), w13.stride(1), *_scale_strides(s13, int4),
        TOPK=top_k, INT4=int4, N_KB=plan.n_kb1, KB_PER=plan.kb_per, MT=mt, BN=cfg.bn1, BM=cfg.bm, PACKED=paired,
        SCALE_TILE=cfg.scale_tile, DOT_PREC=prec, num_warps=cfg.warps1, num_stages=cfg.stages1)
    h = torch.empty(n_slots, i, dtype=x.dtype, device=dev)  # [t*K, i] silu(gate) * up per slot
    bi = min(cfg.bi, next_pow2(i))
    silu_mul_kernel[(n_slots, triton_cdiv(i, bi))](part, h, topk_idx, i, n_slots, e_start, e_local,
                                                    SPLITS=splits, BI=bi, num_warps=4)
    down_kernel[(expert_programs(slots, rows2 * mt, cfg.grid_e), rows2, mt)](
        h, w2, s2, topk_w, out, counts, active, lists, t, d, i, e_local,
        w2.stride(0), w2.stride(1), *_scale_strides(s2, int4),
        INT4=int4, N_KB=plan.n_kb2, BN=cfg.bn2, BM=cfg.bm, PACKED=paired, SCALE_TILE=cfg.scale_tile, DOT_PREC=prec,
        num_warps=cfg.warps2, num_stages=cfg.stages2)
    bd = min(cfg.bd, next_pow2(d))
    combine_kernel[(t, triton_cdiv(d, bd))](out, topk_idx, y, d, e_start, e_local, K=top_k, BD=bd, num_warps=4)
    return y


def expert_programs(slots: int, per_expert: int, grid_e: int = 0) -> int:
    """Grid dim 0 of an expert GEMM (programs looping over the active experts): grid_e when given, else so that
    there are at most PROGRAMS_PER_SM * SMS programs in all; never above slots = min(e_local, t * K) >= n_active."""
    return max(1, min(slots, grid_e or triton_cdiv(PROGRAMS_PER_SM * SMS, per_expert)))


def _scale_strides(s: torch.Tensor, int4: bool) -> tuple[int, int, int]:
    """(expert, row, group) strides of a scale tensor indexed [e, g, n] (any memory order); zeros when dense."""
    return (s.stride(0), s.stride(2), s.stride(1)) if int4 else (0, 0, 0)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
