"""Launcher of the tree_verify_mla Triton kernels: config table, split plan, workspace size, launch.

Everything here depends on static shapes and the device's facts only (b, n, h, l_max, dtype, SM count,
bytes per flop: plugins/common/device.py), so one call allocates nothing when given a workspace, never
syncs with the host, and can be captured in a CUDA graph once compiled.  See kernel.py for the algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

import plugins.tree_verify_mla.wgmma_launch as wgmma_launch
from core.env_flags import env_flag
from plugins.common.device import device_facts
from plugins.common.pdl import USE_PDL, pdl_args  # PDL on sm_90+ (the combine launches while the split kernel runs)
from plugins.tree_verify_mla.kernel import (
    LOG2E,
    tree_verify_mla_combine_kernel,
    tree_verify_mla_split_kernel,
)

MAX_SPLITS = 512
# KDTREE_ATTN_PREFETCH=1: each split program L2-prefetches its first cache tiles before its PDL wait (kernel.py's
# PREFETCH; sm_90, PDL launches only).  Off until the rank benchmark measures it (benchmarks/k26_switches.py).
CACHE_PREFETCH = env_flag("KDTREE_ATTN_PREFETCH", False)
# a split is at least this many key tiles: 1, because a program takes ~1.9 us per tile in series (H200, h 8, N 1,
# L 4K: 16 / 32 / 64 splits 24.7 / 17.3 / 13.3 us) and 129 one-tile splits ran in 9.85 us (PARTIAL_SHARE still caps
# the partials; the 32K and longer plans are not bound by this)
MIN_TILES_PER_SPLIT = 1
PARTIAL_SHARE = 0.5  # partial o/lse written by all splits <= this share of the request's work in bytes ...
# ... unless all requests' partials fit in this share of the L2: written and read back on chip, they cost no HBM
# bytes (H200, h 8, N 17, L 4K: 22 splits, 6.1 MB of partials, 18.1 us against 21.7 us at the cap's 13)
L2_SHARE = 0.125


@dataclass(frozen=True)
class Config:
    """Tile shape of the split kernel.  block_n must divide 64 (one mask word per key tile).

    dv_split 2: each program owns half of the d_v output columns (scores computed twice, the
    accumulator halved: 64 x 256 fp32 fits one warpgroup).  keys_m: keys are the M side of both
    products (scores^T, o^T), so few query rows still run wgmma with M = 64 keys (block_n 64).
    ctas_per_sm: programs the plan puts on one SM (shared memory permitting), i.e. waves of splits."""
    block_m: int  # (node, head) query rows per program
    block_n: int  # latent rows per key tile: block_n * d_qk * itemsize bytes per pipeline stage
    num_warps: int
    num_stages: int
    dv_split: int = 1
    keys_m: bool = False
    ctas_per_sm: int = 1
    wgmma: bool = False  # the CUDA C split kernel (tree_verify_wgmma.cu, sm_90a): block 64 x 64, two warpgroups

    def tag(self) -> str:
        return (f"m{self.block_m}-n{self.block_n}-w{self.num_warps}-s{self.num_stages}"
                + (f"-dv{self.dv_split}" if self.dv_split > 1 else "") + ("-keysm" if self.keys_m else "")
                + (f"-x{self.ctas_per_sm}" if self.ctas_per_sm > 1 else "") + ("-wgmma" if self.wgmma else ""))


# Per regime, by m = n * h query rows per request: (largest m, config).  Resource use from the sm_90
# cubin (Triton 3.6, cuobjdump --dump-resource-usage; NOTES.md has the table and the reasoning).
# Triton issues the cp.async of tile i + stages - 1 near the END of iteration i (after the wgmma that
# frees its buffer), so with 2 stages the next tile's HBM latency is exposed every iteration: every
# choice below has >= 3 stages or >= 2 programs per SM.
#   m <= 16 (h = 8, N <= 2; memory-bound): 16 x 32 tiles on mma.sync, 3 stages (91 KB, 128 registers)
#     and two programs per SM (2 x the splits): 4 tiles in flight per SM, and one program computes
#     while the other waits.
#   m <= 32 (N = 4): keys as M (scores^T = k q^T on wgmma 64x32, o^T += v^T p^T): q read once per
#     tile instead of once per warp (the 32 x 32 8-warp mma.sync version was smem-bound), 184 KB.
#   32 < m <= 1024 (N = 8 memory-bound, and compute-bound up to h = 128 x N = 8): 64 rows x 32 keys, one warpgroup,
#     half of d_v per program (dv_split 2): no cross-warpgroup reductions or p exchange per tile
#     (the 8-warp version split every row over two warpgroups and ran ~4x under the tensor rate),
#     3 stages, 181 KB, 255 registers, 8 B of spills; 1.53x the flops, predicted net ~1.6x faster.
#   m > 1024 (compute-bound: h = 64 x N = 64): 64 x 64 tiles, two warpgroups, 2 stages, whole d_v: the H200
#     sweep of 2026-12-03 timed it at 1125 us against 1500 us for the dv_split-2 tiles (h64 N64 L32K).
# fp32 inputs (tiny test models) take exact fp32 dots on the FMA units: small tiles.
# The benchmark's sweep (benchmarks/tree_verify_mla.py) times the alternatives on the H200.
CONFIGS_16BIT: tuple[tuple[int, Config], ...] = (
    (16, Config(block_m=16, block_n=32, num_warps=4, num_stages=3, ctas_per_sm=2)),
    (32, Config(block_m=32, block_n=64, num_warps=4, num_stages=2, keys_m=True)),
    (1024, Config(block_m=64, block_n=32, num_warps=4, num_stages=3, dv_split=2)),
    (1 << 62, Config(block_m=64, block_n=64, num_warps=8, num_stages=2)),
)
# KDTREE_ATTN_LONG_TILE (on; =0 turns it off; k26_switches attn_long): at most 16 query rows (an AR step at h = 8)
# over a cache of LONG_TILE_MIN to LONG_TILE_MAX rows, 64-key tiles, 3 stages, one program per SM.  The H200 sweep
# (benchmarks/results/tree_verify_mla_sweep.json, 2026-12-03) timed it at 19.88 µs against the table's 21.35 at
# N = 1, L = 32K; at 128K the table's choice won (55.7 against 65.4 with 64-key tiles, 2 stages).  The K2.6 rank at
# 40 layers and a 32K cache (H100, benchmarks/results/k26-switches-h100.json call 5): AR step 4060.6 -> 3934.5 µs
# (-3.1 %); DDTree rounds do not take it (17 tokens x 8 heads)
LONG_TILE = env_flag("KDTREE_ATTN_LONG_TILE", True)
LONG_TILE_CONFIG = Config(block_m=16, block_n=64, num_warps=4, num_stages=3)
LONG_TILE_MIN, LONG_TILE_MAX = 16384, 65536
# KDTREE_ATTN_WGMMA (on; =0 turns it off; k26_switches attn_wgmma): requests of 33..1024 query rows (a DDTree round
# at h = 8: 5..128 nodes) on an sm_90 GPU, bf16, d_qk 576 / d_v 512, take the CUDA C split kernel
# (tree_verify_wgmma.cu): one CTA of two warpgroups computes a 64-row block's scores once and splits the 512 value
# columns, where the table's Triton tiles compute them twice (dv_split 2).  Same plan, workspace and combine.  K2.6
# rank, 40 layers, H100 (results/k26-switches-h100.json calls 8-10): DDTree-16 -12.5 %, DDTree-32 -16.8 % at 32K,
# level at 4K (-0.7 .. +0.2 %); the kernel alone at N 17 32K 67.9 -> 42.7 µs, N 64 32K 170.8 -> 91.3 µs (NOTES.md).
WGMMA = env_flag("KDTREE_ATTN_WGMMA", True)
WGMMA_CONFIG = Config(block_m=64, block_n=64, num_warps=8, num_stages=2, wgmma=True)
WGMMA_ROWS = (33, 1024)
# KDTREE_ATTN_WGMMA_AR (on; =0 turns it off; k26_switches attn_wgmma_ar): requests of 1..32 query rows (the AR step at
# h = 8, DDTree rounds of up to 3 nodes) take the wgmma split kernel too: one 64-key tile a split by TMA (65 splits at
# 4K) where the table's Triton tiles take 32 keys (129 splits); with wgmma_launch.EARLY its tile loads under q_absorb.
# H200, K2.6 rank at 40 layers, 4K, with EARLY: AR step -1.4 % (results/k26-switches.json)
WGMMA_AR = env_flag("KDTREE_ATTN_WGMMA_AR", True)
# KDTREE_ATTN_WGMMA_WIDE (on; =0 turns it off; k26_switches attn_wgmma_wide): more than 1024 query rows too (DDTree
# rounds of budget 128 and 256 at h = 8: 1032 and 2056 rows), which the Triton table's 64 x 64 tiles take otherwise.
# H100, K2.6 rank at 40 layers, 4K: DDTree-128 step -5.0 %, DDTree-256 -5.6 %
# (results/k26-switches-h100.json calls 19-20)
WGMMA_WIDE = env_flag("KDTREE_ATTN_WGMMA_WIDE", True)
CONFIGS_FP32: tuple[tuple[int, Config], ...] = (  # 128 registers, no spill (4 warps: 255 and 1 KB of spills)
    (1 << 62, Config(block_m=16, block_n=32, num_warps=8, num_stages=2)),
)


@dataclass(frozen=True)
class Plan:
    config: Config
    num_splits: int  # splits of the committed range; 1 = no workspace, no combine


def pick_config(m: int, dtype: torch.dtype, l_max: int = 0) -> Config:
    """The table's config for m query rows a request (LONG_TILE's for a few rows over a long 16-bit cache)."""
    if LONG_TILE and dtype != torch.float32 and m <= LONG_TILE_CONFIG.block_m \
            and LONG_TILE_MIN <= l_max < LONG_TILE_MAX:
        return LONG_TILE_CONFIG
    table = CONFIGS_FP32 if dtype == torch.float32 else CONFIGS_16BIT
    return next(cfg for limit, cfg in table if m <= limit)


def plan(b: int, n: int, h: int, l_max: int, dtype: torch.dtype, device: torch.device | str,
         config: Config | None = None, num_splits: int | None = None, d_qk: int = 576, d_v: int = 512,
         num_sms: int | None = None) -> Plan:
    """Tile config and split count from static shapes on `device` (the inputs' device; its SM count
    unless num_sms overrides it): about config.ctas_per_sm waves of programs (units = b * m-blocks *
    dv_split programs per split), each split at least MIN_TILES_PER_SPLIT key tiles long, and the fp32
    partials of all splits (m * (d_v + 1) * 4 B each) at most PARTIAL_SHARE of the request's work
    counted in bytes, max(latent rows read, flops * the device's bytes per flop), or at most L2_SHARE of the
    device's L2 for all b requests, whichever allows more."""
    m = n * h
    cfg = config or (WGMMA_CONFIG if _wgmma_wanted(m, dtype, device, d_qk, d_v) else pick_config(m, dtype, l_max))
    if num_splits is None:
        facts = device_facts(device)
        num_sms = num_sms or facts.sms
        units = b * triton.cdiv(m, cfg.block_m) * cfg.dv_split
        tiles = triton.cdiv(l_max, cfg.block_n) + triton.cdiv(n, cfg.block_n)
        work = max(l_max * d_qk * torch.finfo(dtype).bits // 8, 2 * m * l_max * (d_qk + d_v) * facts.bytes_per_flop)
        split_bytes = m * (d_v + 1) * 4  # one split's partials of one request
        by_partials = max(int(PARTIAL_SHARE * work // split_bytes), int(L2_SHARE * facts.l2_bytes // (b * split_bytes)))
        num_splits = max(1, min(num_sms * cfg.ctas_per_sm // max(units, 1), tiles // MIN_TILES_PER_SPLIT,
                                by_partials, MAX_SPLITS))
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"tree_verify_mla: num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    return Plan(cfg, num_splits)


def _wgmma_wanted(m: int, dtype: torch.dtype, device: torch.device | str, d_qk: int, d_v: int) -> bool:
    """Whether the plan takes WGMMA_CONFIG: switched on, rows in WGMMA_ROWS (from 1 with WGMMA_AR, unbounded with
    WGMMA_WIDE), bf16 576 / 512, and the kernel loads on this CUDA device (sm_90)."""
    lo, hi = 1 if WGMMA_AR else WGMMA_ROWS[0], 1 << 62 if WGMMA_WIDE else WGMMA_ROWS[1]
    if not (WGMMA and wgmma_launch.takes(dtype, d_qk, d_v) and lo <= m <= hi and torch.device(device).type == "cuda"):
        return False
    return wgmma_launch.available(torch.device(device))


def workspace_numel(b: int, n: int, h: int, d_v: int, l_max: int, dtype: torch.dtype, device: torch.device | str,
                    config: Config | None = None, num_splits: int | None = None, d_qk: int = 576,
                    num_sms: int | None = None) -> int:
    """fp32 elements of the workspace for these static shapes on `device` (and overrides, as plan):
    partial o [b, s, n*h, d_v] then partial lse [b, s, n*h]; 0 when the plan has one split."""
    p = plan(b, n, h, l_max, dtype, device, config, num_splits, d_qk, d_v, num_sms)
    if p.num_splits == 1:
        return 0
    return b * p.num_splits * n * h * (d_v + 1)


def kernel_supports(dtype: torch.dtype, d_qk: int, d_v: int) -> bool:
    """Whether the Triton kernel takes these: bf16/fp16/fp32, d_v and d_qk - d_v powers of two >= 16."""
    d_r = d_qk - d_v
    return dtype in (torch.bfloat16, torch.float16, torch.float32) and all(
        d >= 16 and not d & (d - 1) for d in (d_v, d_r))


def _prefetchable(cache: torch.Tensor) -> bool:
    """The cache rows' bulk L2 prefetch needs 16-byte aligned addresses and sizes."""
    size = cache.element_size()
    return cache.data_ptr() % 16 == 0 and (cache.stride(0) * size) % 16 == 0 and (cache.stride(1) * size) % 16 == 0


def _check_layout(q, cache, tree_kv, tree_mask, out, lse, d_v: int, d_r: int) -> None:
    for name, t in (("q", q), ("cache", cache), ("tree_kv", tree_kv), ("tree_mask", tree_mask), ("out", out),
                    ("lse", lse)):
        if t.stride(-1) != 1:
            raise ValueError(f"tree_verify_mla: {name} must have a contiguous last dim, got strides {t.stride()}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"tree_verify_mla: q must be bf16, fp16 or fp32 for the Triton kernel, got {q.dtype}")
    if out.dtype != q.dtype and out.dtype != torch.float32:
        raise ValueError(f"tree_verify_mla: out must be {q.dtype} or fp32, got {out.dtype}")
    for name, d in (("d_v", d_v), ("d_r = d_qk - d_v", d_r)):
        if d < 16 or d & (d - 1):
            raise ValueError(f"tree_verify_mla: {name} must be a power of two >= 16 for the Triton kernel, got {d}")


def tree_verify_mla_triton(q: torch.Tensor, cache: torch.Tensor, cache_lens: torch.Tensor, tree_kv: torch.Tensor,
                           tree_mask: torch.Tensor, scale: float, out: torch.Tensor, lse: torch.Tensor,
                           workspace: torch.Tensor | None = None, config: Config | None = None,
                           num_splits: int | None = None, num_sms: int | None = None,
                           pdl: bool | None = None) -> None:
    """Writes out [b, n, h, d_v] and lse [b, n, h] (the reference's function, see reference.py).

    workspace: fp32, >= workspace_numel(...) elements for the same static shapes and overrides;
    allocated here (static shape) when None.  config / num_splits override the table and the plan
    (benchmark sweeps, tests); num_sms defaults to the device's SM count; pdl (programmatic dependent
    launch) defaults to USE_PDL on sm_90+ CUDA devices and is off elsewhere.  Shapes and dtypes are
    checked by plugins.tree_verify_mla.check_inputs; this checks the layout the kernel needs.
    """
    b, n, h, d_qk = q.shape
    l_max = cache.shape[1]
    d_v = out.shape[-1]
    d_r = d_qk - d_v
    _check_layout(q, cache, tree_kv, tree_mask, out, lse, d_v, d_r)
    if b == 0 or n == 0 or h == 0:
        return
    p = plan(b, n, h, l_max, q.dtype, q.device, config, num_splits, d_qk, d_v, num_sms)
    cfg = p.config
    if cfg.wgmma and not (wgmma_launch.takes(q.dtype, d_qk, d_v) and wgmma_launch.available(q.device)
                          and wgmma_launch.aligned(q, cache, tree_kv)):
        cfg = pick_config(n * h, q.dtype, l_max)  # the plan's splits and workspace, the Triton tiles
    if 64 % cfg.block_n or cfg.block_n < 16 or cfg.block_m < 16 or cfg.dv_split not in (1, 2) \
            or d_v // cfg.dv_split < 16:
        raise ValueError(f"tree_verify_mla: config needs 16 <= block_n | 64, block_m >= 16, dv_split in (1, 2) "
                         f"and d_v / dv_split >= 16, got {cfg} for d_v {d_v}")
    pdl = (USE_PDL if pdl is None else pdl) and q.is_cuda and device_facts(q.device).capability[0] >= 9
    launch = pdl_args(pdl)  # the PDL constexpr, and the launch attribute with it (the interpreter takes none)
    prefetch = {"PREFETCH": True} if pdl and CACHE_PREFETCH and _prefetchable(cache) else {}  # the split kernel's
    s = p.num_splits
    m_rows = n * h
    need = 0 if s == 1 else b * s * m_rows * (d_v + 1)
    if need and workspace is None:
        workspace = torch.empty(need, dtype=torch.float32, device=q.device)
    if need:
        if workspace.dtype != torch.float32 or workspace.device != q.device or not workspace.is_contiguous() \
                or workspace.numel() < need:
            raise ValueError(f"tree_verify_mla: workspace must be contiguous fp32 on {q.device} with >= {need} "
                             f"elements, got {workspace.dtype} {workspace.device} numel {workspace.numel()}")
        o_part = workspace[:b * s * m_rows * d_v]  # [b, s, m, d_v]
        l_part = workspace[b * s * m_rows * d_v:need]  # [b, s, m]
    else:
        o_part = l_part = lse  # unused by the one-split kernel

    if cfg.wgmma:
        wgmma_launch.launch_split(q, cache, cache_lens, tree_kv, tree_mask, out, lse, o_part, l_part, s,
                                  float(scale) * LOG2E, pdl)
    else:
        _launch_triton_split(q, cache, cache_lens, tree_kv, tree_mask, out, lse, o_part, l_part, cfg, s, scale,
                             launch, prefetch)
    if s == 1:
        return
    s_pad = triton.next_power_of_2(s)
    block_dv = min(d_v, max(16, 8192 // s_pad))
    tree_verify_mla_combine_kernel[(m_rows, d_v // block_dv, b)](
        o_part, l_part, out, lse,
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        n, h, s,
        S_PAD=s_pad, D_V=d_v, BLOCK_DV=block_dv, num_warps=4, **launch)


def _launch_triton_split(q, cache, cache_lens, tree_kv, tree_mask, out, lse, o_part, l_part, cfg: Config, s: int,
                         scale: float, launch: dict, prefetch: dict) -> None:
    """The Triton split kernel over grid (m-blocks x dv_split, s, b); the arguments as tree_verify_mla_triton's."""
    b, n, h, d_qk = q.shape
    d_v = out.shape[-1]
    grid = (triton.cdiv(n * h, cfg.block_m) * cfg.dv_split, s, b)
    tree_verify_mla_split_kernel[grid](
        q, cache, cache_lens, tree_kv, tree_mask, out, lse, o_part, l_part,
        q.stride(0), q.stride(1), q.stride(2),
        cache.stride(0), cache.stride(1),
        tree_kv.stride(0), tree_kv.stride(1),
        tree_mask.stride(0), tree_mask.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        n, h, cache.shape[1], s, float(scale) * LOG2E,
        D_V=d_v, D_R=d_qk - d_v, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, DV_SPLIT=cfg.dv_split, KEYS_M=cfg.keys_m,
        DIRECT=s == 1, IEEE=q.dtype == torch.float32, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **launch, **prefetch)
