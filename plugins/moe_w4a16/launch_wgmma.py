"""Launcher of moe_wgmma.cu: moe_w4a16's two expert GEMMs (gate_up, down) on Hopper's warpgroup MMA where the
experts see many tokens, on the same fragment-order experts and workspace as launch_v3.py, which calls it between
its route kernel and its combine (the same four launches, the same h and out buffers).

Why (moe_wgmma.cu's header): v3's mma.sync kernels dequantise an expert's weights once per 8 or 16 of its tokens;
here once per up to 64 (wgmma N = 16, 32 or 64, weights as A from registers).  sm_90 only (sm_90a's wgmma); shapes
of whole 4-pair row blocks, k groups in fours and i <= 512 (an entry's whole h tile in shared memory).

Off by default (ENABLED): measured slower than v3's kernels below t = 512 (NOTES.md); KDTREE_MOE_WGMMA=1 takes it
from MIN_TOKENS tokens.  (The warp-specialised forms and gate_up's tokens by TMA, measured no faster, are gone:
NOTES.md "The warp-specialised expert GEMMs", "gate_up's tokens by TMA".)
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from core.env_flags import env_flag
from plugins.common.cubin import load_module
from plugins.common.device import device_facts
from plugins.common.device_modules import NotForThisDevice, PerDevice
from plugins.common.driver import Functions, launch
from plugins.common.pdl import USE_PDL
from plugins.moe_w4a16.plan import cdiv

SOURCE = Path(__file__).with_name("moe_wgmma.cu")
THREADS = 128  # one warpgroup (the .cu's WG)
TILE = 64  # token slots an entry (the .cu's TILE: wgmma N up to 64)
RB = 4  # row pairs an item (the .cu's RB)
P_GROUPS = 4  # the weight ring's depth (the .cu's P_GROUPS): k groups per row pair a multiple of it
X_STAGES = 3  # gate_up's 64-k token blocks in shared memory
BLOCK_BYTES = TILE * 128  # one 64-row x 64-k bf16 block
H_BLOCKS_MAX = 8  # down's h tile: kp_i / 64 blocks at most (i <= 512)
CTAS_PER_SM = 2  # __launch_bounds__(128, 2)
# Off (KDTREE_MOE_WGMMA=1 turns it on): slower than v3's mma.sync kernels below t = 512 and 2-5 % faster at 512
# (H100, 2026-12-07: results/moe_w4a16_v3-h100.json, NOTES.md "The expert GEMMs on wgmma ...")
ENABLED = env_flag("KDTREE_MOE_WGMMA", False)
MIN_TOKENS = 64  # t from which launch_v3 takes these kernels (below, most experts see <= 16 tokens: v3's tiles)
FORCE: bool | None = None  # tests and benchmarks: True / False overrides ENABLED and MIN_TOKENS


class MoEWgmmaWarning(UserWarning):
    """moe_wgmma.cu cannot be loaded on a device: the MoE's GEMMs stay v3's mma.sync kernels there."""


@dataclass
class _Kernels:
    cu: object
    funcs: Functions  # the loaded cubin's kernels
    pdl: bool


def _load(dev: torch.device) -> _Kernels:
    arch = device_facts(dev).arch
    if arch != "sm_90":
        raise NotForThisDevice(f"{arch} has no wgmma (sm_90a)")
    from cuda.bindings import driver as cu
    torch.empty(1, device=dev)  # the primary context, current before the driver loads the module
    module, _ = load_module(SOURCE, dev, "moe_w4a16 wgmma")
    return _Kernels(cu, Functions(cu, module, "moe_w4a16 wgmma"), USE_PDL)


_KERNELS: PerDevice[_Kernels] = PerDevice("moe_w4a16 wgmma", MoEWgmmaWarning, "the MoE's GEMMs stay v3's mma.sync")


def shapes_fit(pairs13: int, groups13: int, pairs2: int, groups2: int) -> bool:
    """Whether the experts' fragment shapes suit the kernels: whole blocks of RB row pairs, k groups in multiples of
    the ring's depth, and i's groups (down's k) within the h tile's H_BLOCKS_MAX 64-k blocks."""
    return (pairs13 % RB == 0 and pairs2 % RB == 0 and groups13 % P_GROUPS == 0 and groups2 % P_GROUPS == 0
            and groups2 // 2 <= H_BLOCKS_MAX)


def applies(t: int, device: torch.device, pairs13: int, groups13: int, pairs2: int, groups2: int) -> bool:
    """Whether launch_v3 takes these kernels for a call of t tokens (loading them at the first ask on an sm_90 GPU,
    never inside a capture; one MoEWgmmaWarning naming why when they do not load)."""
    on = (ENABLED and t >= MIN_TOKENS) if FORCE is None else FORCE
    return on and shapes_fit(pairs13, groups13, pairs2, groups2) and _KERNELS.get(device, _load) is not None


def max_entries(t: int, top_k: int, e_local: int) -> int:
    """Bound on (expert, tile of TILE slots) entries: each active expert's last tile may be partial."""
    return min(e_local, t * top_k) + cdiv(t * top_k, TILE)


def gate_up_smem(t: int, top_k: int, e_local: int) -> int:
    """The .cu's layout: alignment slack, X_STAGES token blocks, h staged [64][64] bf16, slots, the entry list."""
    return 1024 + X_STAGES * BLOCK_BYTES + TILE * 64 * 2 + (TILE + 4 + e_local + max_entries(t, top_k, e_local)) * 4


def down_smem(t: int, top_k: int, e_local: int, groups2: int) -> int:
    """alignment slack, the h tile (groups2 / 2 blocks), out staged [64][128] bf16, slots and weights, entries."""
    return (1024 + groups2 // 2 * BLOCK_BYTES + TILE * 128 * 2
            + (2 * TILE + 4 + e_local + max_entries(t, top_k, e_local)) * 4)


def _launch(dev: torch.device, name: str, items: int, smem: int, args: tuple, types: tuple,
            threads: int = THREADS, ctas_per_sm: int = CTAS_PER_SM) -> None:
    mod = _KERNELS[dev]
    grid = max(1, min(items, ctas_per_sm * device_facts(dev).sms))
    stream = mod.cu.CUstream(torch.cuda.current_stream(dev).cuda_stream)
    launch(mod.cu, mod.funcs.get(name, smem), grid, threads, smem, stream, args, types, mod.pdl,
           f"moe_w4a16 wgmma: launch {name}", _KERNELS.index(dev))


def gate_up(w13: torch.Tensor, w13_scale: torch.Tensor, x: torch.Tensor, counts: torch.Tensor, lists: torch.Tensor,
            h: torch.Tensor, t: int, top_k: int, e_local: int, i: int) -> None:
    """h [t * top_k, i] = silu(gate) * up of each routed slot (applies() said yes).  w13 [e_l, 2i/32, kp_d/32, 32, 4],
    x [t, d] bf16, counts / lists the route kernel's."""
    pairs13, groups13 = w13.shape[1:3]
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    args = (w13.data_ptr(), w13_scale.data_ptr(), x.data_ptr(), counts.data_ptr(), lists.data_ptr(), h.data_ptr(),
            t, top_k, e_local, x.shape[1] // 32, groups13, pairs13, i)
    types = (ptr, ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i32, i32, i32, i32)
    items = max_entries(t, top_k, e_local) * (pairs13 // RB)
    _launch(x.device, "kdtree_moe_wg_gate_up", items, gate_up_smem(t, top_k, e_local), args, types)


def down(w2: torch.Tensor, w2_scale: torch.Tensor, h: torch.Tensor, topk_w: torch.Tensor, counts: torch.Tensor,
         lists: torch.Tensor, out: torch.Tensor, t: int, top_k: int, e_local: int, i: int) -> None:
    """out [t * top_k, d] = topk_w[slot] * (W2_e h[slot]) of each routed slot.  w2 [e_l, d/32, kp_i/32, 32, 4]."""
    pairs2, groups2 = w2.shape[1:3]
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    args = (w2.data_ptr(), w2_scale.data_ptr(), h.data_ptr(), topk_w.data_ptr(), counts.data_ptr(), lists.data_ptr(),
            out.data_ptr(), t, e_local, i // 32, groups2, pairs2, out.shape[1])
    types = (ptr, ptr, ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i32, i32, i32)
    items = max_entries(t, top_k, e_local) * (pairs2 // RB)
    _launch(h.device, "kdtree_moe_wg_down", items, down_smem(t, top_k, e_local, groups2), args, types)
