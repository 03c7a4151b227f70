"""Static launch sizes of the moe_w4a16 Triton path: tiles, k splits and grids, from the shapes and the
device's SM count alone (no Triton needed: the workspace and the CPU path size from it too)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from plugins.common.device import device_facts
from plugins.moe_w4a16.layout import BLOCK_K

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
    """The static launch sizes of one call, from the shapes and the device alone: the tiles, the 256-wide k
    blocks of each GEMM (n_kb1 over d, n_kb2 over i), gate_up's k blocks per split and split count, the token
    tiles in the grid (mt), and the device's SM count.  Kernel variants are keyed by these
    (tests/test_moe_w4a16.py groups its compile warm-up by them)."""
    cfg: KernelConfig
    n_kb1: int
    n_kb2: int
    kb_per: int
    splits: int
    mt: int
    sms: int


def launch_plan(t: int, top_k: int, e_local: int, d: int, i: int, device: torch.device | str,
                config: KernelConfig | None = None) -> LaunchPlan:
    """config (default KernelConfig()) with its 0 fields chosen from the static shapes on `device` (the
    inputs' device: its SM count), from the H200 tile sweep (NOTES.md): bm 16 up to 128 token slots
    (t * top_k), 32 above (64 past 48 slots per local expert); the k split of gate_up so that (experts likely
    active) x (row blocks) x splits fills the SMs about four times over (tree routing touches about half the
    slots' worth of distinct experts)."""
    cfg = config or KernelConfig()
    sms = device_facts(device).sms
    n_slots = t * top_k
    bm = cfg.bm or (16 if n_slots <= 128 else 32 if n_slots <= 48 * e_local else 64)
    n_kb1, n_kb2 = cdiv(d, BLOCK_K), cdiv(i, BLOCK_K)
    blocks = max(1, min(e_local, n_slots) // 2) * cdiv(2 * i, cfg.bn1)
    split = cfg.split or max(1, min(cdiv(4 * sms, blocks), n_kb1))
    kb_per = cdiv(n_kb1, min(split, n_kb1))
    cfg = replace(cfg, bm=bm, split=split, mt=cfg.mt or min(cdiv(t, bm), 4))
    return LaunchPlan(cfg, n_kb1, n_kb2, kb_per, cdiv(n_kb1, kb_per), cfg.mt, sms)


def expert_programs(slots: int, per_expert: int, sms: int, grid_e: int = 0) -> int:
    """Grid dim 0 of an expert GEMM (programs looping over the active experts): grid_e when given, else so that
    there are at most PROGRAMS_PER_SM * sms programs in all; never above slots = min(e_local, t * K) >= n_active."""
    return max(1, min(slots, grid_e or cdiv(PROGRAMS_PER_SM * sms, per_expert)))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
