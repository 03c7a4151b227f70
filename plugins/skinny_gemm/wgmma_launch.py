"""Launcher of skinny_wgmma.cu (y = x . w^T for t <= 32 tokens on Hopper's warpgroup MMA, weights as the M side):
the plan (token slots NT, k splits KS), the tensor maps of w and x, the split workspace, one launch through the driver
API on torch's current stream (capturable in a CUDA graph, PDL on sm_90).  The cubin comes from the artifact, the
kdtree cache or NVRTC/nvcc, compiled for sm_90a (plugins/common/cubin.py).  runtime/model/layers.py decides where it
runs; reference.py is the oracle.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from core.env_flags import env_flag
from plugins.common.device import device_facts
from plugins.common.device_modules import NotForThisDevice, PerDevice
from plugins.common.driver import launch
from plugins.common.pdl import USE_PDL
from plugins.common.tensor_maps import bf16_tensor_map
from plugins.skinny_gemm.launch import KernelModule

SOURCE = Path(__file__).with_name("skinny_wgmma.cu")
THREADS = 128  # one warpgroup (the .cu's THREADS)
BLOCK_M = BLOCK_K = 64  # weight rows a CTA, k columns a box (the .cu's BM, BK)
STAGES = {1: 8, 4: 4}  # boxes a stage -> stages in the ring (the .cu's SKINNY_WGMMA variants)
# KDTREE_SKINNY_WGMMA_KB4=1: four boxes a stage (256 contiguous columns of each weight row in flight together, 4
# stages), where one box a stage reads each row 128 bytes at a time.  Off: faster alone (H100, qkv_a at t = 17 16.9 ->
# 15.2 µs, skinny-gemm-h100.json wgmma_kb4) but the K2.6 rank's DDTree-16 round +0.9 % (k26-switches-h100.json call 13;
# NOTES.md says the likely cause)
KB4 = env_flag("KDTREE_SKINNY_WGMMA_KB4", False)
MAX_TOKENS = 32  # NT = 8, 16, 24 or 32 token slots (wgmma's N)
MAX_SPLITS = 16
PARTS_FLOATS = 1 << 20  # the per-device split workspace: KS x row blocks x 64 x NT partial floats at most ...
TICKETS = 4096  # ... and one ticket a row block (zero between calls: each call's last CTAs put them back)


class SkinnyWgmmaWarning(UserWarning):
    """skinny_wgmma.cu cannot be loaded on a device: its GEMMs stay on the other paths."""


@dataclass(frozen=True)
class Plan:
    kernel: str
    nt: int  # token slots (wgmma N)
    splits: int  # KS
    row_blocks: int
    smem: int
    boxes: int = 1  # 64-column boxes a stage (1 or 4)

    @property
    def grid(self) -> tuple[int, int]:
        return self.row_blocks, self.splits


def smem_bytes(nt: int, boxes: int = 1) -> int:
    """The .cu's dynamic shared memory: STAGES[boxes] stages of `boxes` boxes of w (8 KB) and x (nt x 128 B), the
    mbarriers, the last-CTA flag, and the slack that aligns the ring to 1024 bytes."""
    stages = STAGES[boxes]
    return stages * boxes * (BLOCK_M * BLOCK_K * 2 + nt * BLOCK_K * 2) + stages * 8 + 4 + 1024


def plan(t: int, n: int, k: int, out_f32: bool, sms: int, splits: int | None = None, boxes: int | None = None
         ) -> Plan:
    """The launch for x [t, k] . w [n, k]^T: NT the tokens rounded up to 8; KS the k splits that bring the CTAs (row
    blocks x KS) closest to one a SM without exceeding the stages of `boxes` k boxes (4 where KB4, else 1); splits
    and boxes override, for tests and sweeps."""
    if not 1 <= t <= MAX_TOKENS or k % BLOCK_K:
        raise ValueError(f"skinny_wgmma: needs 1 <= t <= {MAX_TOKENS} and k % {BLOCK_K} == 0, got t {t}, k {k}")
    boxes = boxes or (4 if KB4 else 1)
    if boxes not in STAGES:
        raise ValueError(f"skinny_wgmma: boxes a stage must be one of {sorted(STAGES)}, got {boxes}")
    nt = -(-t // 8) * 8
    blocks, stages = -(-n // BLOCK_M), -(-(k // BLOCK_K) // boxes)
    ks = splits or max(1, min(stages, MAX_SPLITS, round(sms / blocks)))
    if not 1 <= ks <= min(stages, MAX_SPLITS):
        raise ValueError(f"skinny_wgmma: splits must be in [1, {min(stages, MAX_SPLITS)}], got {ks}")
    if ks > 1 and (blocks > TICKETS or ks * blocks * BLOCK_M * nt > PARTS_FLOATS):
        raise ValueError(f"skinny_wgmma: {ks} k splits of {blocks} row blocks exceed the split workspace")
    name = f"kdtree_skinny_wgmma{'_kb4' if boxes == 4 else ''}_t{nt}_{'f32' if out_f32 else 'bf16'}"
    return Plan(name, nt, ks, blocks, smem_bytes(nt, boxes), boxes)


def supports(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor | None, out_f32: bool) -> bool:
    """Whether the kernel takes these: CUDA bf16 x [t <= 32, k] with 16-byte aligned rows, w [n, k] contiguous, k a
    multiple of 64, c (bf16 out only) [t, n] bf16 with a contiguous last dim; and it loads on the device (sm_90)."""
    if not (x.is_cuda and x.dtype == w.dtype == torch.bfloat16 and x.dim() == 2 and w.dim() == 2):
        return False
    t, k = x.shape
    ok = (1 <= t <= MAX_TOKENS and k % BLOCK_K == 0 and w.shape[1] == k and w.is_contiguous() and x.stride(1) == 1
          and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0 and x.device == w.device)
    if c is not None:
        ok = ok and not out_f32 and c.dtype == torch.bfloat16 and c.shape == (t, w.shape[0]) and c.stride(1) == 1 \
            and c.device == x.device
    return ok and available(x.device)


_KERNELS: PerDevice[KernelModule] = PerDevice("skinny_wgmma", SkinnyWgmmaWarning)


def _load(dev: torch.device) -> KernelModule:
    arch = device_facts(dev).arch
    if arch != "sm_90":
        raise NotForThisDevice(f"{arch} has no wgmma (sm_90a)")
    return KernelModule.load(SOURCE, dev, "skinny_wgmma", USE_PDL, PARTS_FLOATS, TICKETS)


def available(device: torch.device) -> bool:
    """Whether the kernels load on `device` (an sm_90 GPU; loaded at the first ask, never inside a CUDA graph capture);
    one SkinnyWgmmaWarning naming why when they do not."""
    return _KERNELS.get(device, _load) is not None


def tensor_map(cu, t: torch.Tensor, box_rows: int) -> object:
    """The CUtensorMap of a [rows, k] bf16 matrix (unit stride along k) as the .cu reads it: boxes of 64 columns x
    box_rows rows, 128-byte swizzle, rows past the end read as zeros (plugins/common/tensor_maps)."""
    rows, k = t.shape
    return bf16_tensor_map(cu, t, (k, rows), (t.stride(0) * t.element_size(),), (BLOCK_K, box_rows), "skinny_wgmma")


def skinny_wgmma(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor | None = None, out_f32: bool = False,
                 splits: int | None = None, pdl: bool | None = None, boxes: int | None = None) -> torch.Tensor:
    """x [t, k] . w [n, k]^T (+ c) -> [t, n] bf16 (fp32 with out_f32), fp32 sums rounded once; supports() was asked
    first.  splits / pdl / boxes override the plan and the defaults (tests, sweeps)."""
    t, k = x.shape
    n = w.shape[0]
    dev = x.device
    mod = _KERNELS[dev]
    p = plan(t, n, k, out_f32, device_facts(dev).sms, splits, boxes)
    y = torch.empty(t, n, dtype=torch.float32 if out_f32 else torch.bfloat16, device=dev)
    cu = mod.cu
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    args = (tensor_map(cu, w, BLOCK_M), tensor_map(cu, x, p.nt), y.data_ptr(), 0 if c is None else c.data_ptr(),
            mod.parts.data_ptr(), mod.tickets.data_ptr(), t, n, k, y.stride(0), 0 if c is None else c.stride(0),
            p.splits)
    types = (None, None, ptr, ptr, ptr, ptr, i32, i32, i32, i32, i32, i32)
    stream = cu.CUstream(torch.cuda.current_stream(dev).cuda_stream)
    func = mod.funcs.get(p.kernel, smem_bytes(32, p.boxes))  # the ceiling: the most any token count asks
    launch(cu, func, p.grid, THREADS, p.smem, stream, args, types, mod.pdl if pdl is None else pdl,
           f"{p.kernel}: launch", dev.index)
    return y
