"""Launcher of skinny_gemm.cu: the plan (variant, warps W, k splits KS) and one launch through the driver API on torch's
current stream (capturable in a CUDA graph; PDL on sm_90+).  See skinny_gemm.cu for the algorithm.

The plan depends on (n, k, the device's SM count) for W and KS, and on t only for the token tiles TT and the row
groups per CTA RG (which change which CTA sums an element, not the order): so the order in which an output element
is summed does not depend on t, and a token's row is the same bits in an AR step and in a tree round.  The cubin
comes from the artifact, the kdtree cache or NVRTC/nvcc (plugins/common/cubin.py).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from plugins.common.cubin import load_module
from plugins.common.device import device_facts
from plugins.common.device_modules import PerDevice
from plugins.common.driver import Functions, launch
from plugins.common.pdl import USE_PDL

SOURCE = Path(__file__).with_name("skinny_gemm.cu")
MAX_TOKENS = 32  # TT = 4 tiles of 8 tokens: more tokens are cuBLAS's (compute starts to matter)
ROWS = 16  # weight rows of a row group (mma's M); a CTA takes RG row groups
BLOCK_K = 32  # k columns per block (two mma k steps)
MAX_WARPS = 16  # 512 threads per CTA (skinny_gemm.cu's launch bounds)
WARPS_PER_SM = 16  # the plan's target of resident warps per SM (<= 128 registers each: a whole SM at 16)
# blocks in flight per warp (RG KB of weights each), per (token tiles TT, row groups per CTA RG): the compiled
# variants, the plan's first (the deepest that fits 128 registers without spilling on sm_90, ptxas -v;
# benchmarks/skinny_gemm.py's sweep times the other)
U_VARIANTS = {(1, 1): (8, 4), (2, 1): (6, 4), (3, 1): (5, 3), (4, 1): (4, 2),
              (2, 2): (4, 2), (3, 2): (3, 2), (4, 2): (2, 1)}
# two row groups (32 weight rows) per CTA for t > 8: each warp loads a block's token columns once for both groups,
# halving the x bytes every CTA reads from L2 (at t = 16 as many as the weights' bytes with one group).  The CTAs
# halve too, so only where the 16-row plan's CTAs, halved, still cover every SM: below that the SMs left idle
# cost more weight bandwidth than the x reads do (K2.6 TP8 on 132 SMs: o_proj, shared down and the dense MLP
# pair their groups; qkv_a (66 CTAs), q_b (96) and the router (112) would not).  W and KS do not depend on it, so
# neither does the sum order (the tests check it).  False: one row group per CTA everywhere.
ROW_GROUP_PAIRS = True
PARTS_FLOATS = 1 << 20  # the per-device split-k workspace: partial tiles (4 MB) ...
TICKETS = 4096  # ... and one ticket counter per CTA column (a plan with KS > 1 has fewer groups than SMs)
# pf's default: each CTA L2-prefetches its weights before its PDL wait.  None: where the plan splits k (KS > 1), the
# shapes where it won on the H200 at t = 1 (benchmarks/results/skinny-gemm.json: router + shared gate_up 7.1 -> 6.6
# µs, q_b 4.9 -> 4.6; it cost the KS = 1 shapes: qkv_a 10.9 -> 11.3, o_proj 6.7 -> 6.9); True / False: every plan
PREFETCH: bool | None = None
# the next kernel launches (PDL) once every CTA has finished its k loop, not once every CTA has passed its wait: its
# early CTAs, waiting, would hold SM slots a second wave of this kernel needs (k26_ablate measured the AR step 132 µs
# slower without the norm kernels between the GEMMs; unmeasured: benchmarks/k26_switches.py's skinny_late)
LATE_TRIGGER = False
# each warp's first U blocks of weights are loaded into registers before the PDL wait, so their DRAM latency overlaps
# the predecessor's tail (the L2 prefetch of a CTA's whole range, PREFETCH, lost 2 % of the AR step: it re-reads
# every byte from L2 and streams beside the predecessor; these loads are the ones the k loop consumes).  Same bits.
# On since measured (2026-12-05, H100, K2.6 TP8 rank at 40 layers, benchmarks/results/k26-switches-h100.json): AR
# step -4.6 % with the 16-warp MoE gate_up, -5.3 % beside the MoE's early weights; DDTree rounds unchanged (their
# GEMMs are cuBLAS's).  An older cubin ignores the flag
EARLY_WEIGHTS = True
FLAG_PREFETCH, FLAG_LATE_TRIGGER, FLAG_EARLY_WEIGHTS = 1, 2, 4  # skinny_gemm.cu's flags
# weights larger than this stay cuBLAS's: the lm_head slice (294 MB at K2.6 TP8) already runs at 93 % of HBM there
MAX_WEIGHT_BYTES = 128 << 20


@dataclass(frozen=True)
class Plan:
    kernel: str  # skinny_gemm.cu's function name
    warps: int  # W: warps per CTA, splitting the CTA's k range
    splits: int  # KS: CTAs per CTA column, splitting k
    groups: int  # row groups of 16 weight rows
    smem: int  # dynamic shared memory bytes
    row_groups: int = 1  # RG: row groups per CTA (a CTA column covers 16 RG weight rows)

    @property
    def grid(self) -> tuple[int, int]:
        return -(-self.groups // self.row_groups), self.splits


def token_tiles(t: int) -> int:
    return 1 if t <= 8 else 2 if t <= 16 else 3 if t <= 24 else 4


def row_groups_per_cta(t: int, n: int, k: int, sms: int) -> int:
    """RG: 2 for t > 8 where the plan's CTAs with two row groups each, ceil(groups / 2) x KS, still cover the SMs
    (ROW_GROUP_PAIRS on), else 1.  KS stays the 16-row plan's (split_shape): RG never changes W or KS."""
    return _row_groups(t, -(-n // ROWS), split_shape(n, k, sms)[1], sms)


def _row_groups(t: int, groups: int, ks: int, sms: int) -> int:
    """row_groups_per_cta's rule on the plan's 16-row group count and k splits."""
    return 2 if ROW_GROUP_PAIRS and t > 8 and -(-groups // 2) * ks >= sms else 1


def split_shape(n: int, k: int, sms: int) -> tuple[int, int]:
    """(W, KS) from the weight's shape and the SM count only: at least one CTA per SM (KS splits of k when the row
    groups are fewer than the SMs, each split >= 8 blocks), then the warps per CTA that keep about WARPS_PER_SM
    warps per SM resident, each with >= 2 blocks of its CTA's range."""
    groups, blocks = -(-n // ROWS), k // BLOCK_K
    ks = 1
    while groups * ks < sms and ks * 2 <= blocks // 8:
        ks *= 2
    w = MAX_WARPS
    while w > 1 and (groups * ks * w > WARPS_PER_SM * sms or blocks // ks < 2 * w):
        w //= 2
    return w, ks


def plan(t: int, n: int, k: int, out_f32: bool, add_c: bool, sms: int, u: int | None = None,
         warps: int | None = None, splits: int | None = None, row_groups: int | None = None) -> Plan:
    """The launch for x [t, k] . w [n, k]^T; u / warps / splits / row_groups override the choice (benchmark sweeps,
    tests)."""
    tt, groups = token_tiles(t), -(-n // ROWS)
    w, ks = split_shape(n, k, sms)
    rg = row_groups or _row_groups(t, groups, ks, sms)
    if (tt, rg) not in U_VARIANTS:
        raise ValueError(f"skinny_gemm: no variant of {rg} row groups per CTA for {tt} token tiles (t = {t})")
    w, ks, u = warps or w, splits or ks, u or U_VARIANTS[tt, rg][0]
    cols = -(-groups // rg)  # CTA columns: one ticket and KS partial tiles of RG x TT x 128 floats each
    if ks > 1 and (cols > TICKETS or cols * ks * rg * tt * 128 > PARTS_FLOATS):
        raise ValueError(f"skinny_gemm: {ks} k splits of {cols} CTA columns exceed the split workspace")
    out = "f32" if out_f32 else "bf16_c" if add_c else "bf16"
    name = f"kdtree_skinny_gemm_t{tt}{'_r2' if rg == 2 else ''}_u{u}_{out}"  # RG = 1: the names before RG
    return Plan(name, w, ks, groups, (w * rg * tt * 128 + 1) * 4, rg)


def prefetch_for(p: Plan) -> bool:
    """Whether a launch of plan p prefetches its weights by default (PREFETCH)."""
    return p.splits > 1 if PREFETCH is None else PREFETCH


def supports(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor | None, out_f32: bool) -> bool:
    """Whether the kernel takes these: CUDA bf16 x [t <= 32, k] with 16-byte aligned rows, w [n, k] contiguous of at
    most MAX_WEIGHT_BYTES, k % 32 == 0, c (bf16 out only) [t, n] bf16 with a contiguous last dim."""
    if not (x.is_cuda and x.dtype == w.dtype == torch.bfloat16 and x.dim() == 2 and w.dim() == 2):
        return False
    t, k = x.shape
    ok = (1 <= t <= MAX_TOKENS and k % BLOCK_K == 0 and w.shape[1] == k and w.is_contiguous() and x.stride(1) == 1
          and w.numel() * 2 <= MAX_WEIGHT_BYTES
          and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0 and x.device == w.device)
    if c is not None:
        ok = ok and not out_f32 and c.dtype == torch.bfloat16 and c.shape == (t, w.shape[0]) and c.stride(1) == 1 \
            and c.device == x.device
    return ok and available(x.device)


class SkinnyGemmWarning(UserWarning):
    """skinny_gemm.cu cannot be loaded on a device: its GEMMs stay cuBLAS's."""


@dataclass
class KernelModule:
    """One device's loaded kernels and split-k workspace (skinny_gemm.cu's here, skinny_wgmma.cu's in
    wgmma_launch.py).  The workspace serves the calls of one stream at a time (each call's last CTAs leave its tickets
    zero for the next): the decode round's, eager or replayed."""
    cu: object
    funcs: Functions  # the loaded cubin's kernels
    pdl: bool  # ask for PDL (sm_90+ and KDTREE_PDL; plugins/common/driver.launch remembers a refusal)
    parts: torch.Tensor  # [parts floats] fp32
    tickets: torch.Tensor  # [tickets] int32, zero between calls

    @classmethod
    def load(cls, source: Path, dev: torch.device, what: str, pdl: bool, parts: int, tickets: int) -> KernelModule:
        """source's cubin loaded on dev (a CUDA device with an index) and a fresh split workspace."""
        from cuda.bindings import driver as cu
        torch.empty(1, device=dev)  # the primary context, current before the driver loads the module
        module, _ = load_module(source, dev, what)
        return cls(cu, Functions(cu, module, what), pdl, torch.empty(parts, dtype=torch.float32, device=dev),
                   torch.zeros(tickets, dtype=torch.int32, device=dev))


_KERNELS: PerDevice[KernelModule] = PerDevice("skinny_gemm", SkinnyGemmWarning, "the few-token GEMMs stay cuBLAS's")


def _load(dev: torch.device) -> KernelModule:
    return KernelModule.load(SOURCE, dev, "skinny_gemm", USE_PDL and device_facts(dev).capability[0] >= 9,
                             PARTS_FLOATS, TICKETS)


def available(device: torch.device) -> bool:
    """Whether the kernels load on `device` (loading them at the first ask); one SkinnyGemmWarning, naming why, when
    they do not (no cubin for the arch and no compiler, no cuda-python, the driver refused the module).  Asked first
    inside a CUDA graph capture, False without loading (the runtime's warm-up calls come before any capture)."""
    return _KERNELS.get(device, _load) is not None


def _module(device: torch.device) -> KernelModule:
    """The loaded module and split workspace of `device` (loaded at its first call, which must not be inside a CUDA
    graph capture: the workspace would live in the capture's pool)."""
    return _KERNELS.require(device, _load)


def skinny_gemm_cuda(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor | None, out_f32: bool, pf: bool | None = None,
                     u: int | None = None, warps: int | None = None, splits: int | None = None,
                     row_groups: int | None = None) -> torch.Tensor:
    """y [t, n] = x [t, k] . w [n, k]^T (+ c), fp32 accumulation, bf16 (or fp32 with out_f32) out; the inputs as
    supports() takes them.  pf: L2-prefetch each CTA's weights first (before the PDL wait); None: PREFETCH's choice.
    u / warps / splits / row_groups: plan()'s overrides."""
    t, k = x.shape
    p = plan(t, w.shape[0], k, out_f32, c is not None, device_facts(x.device).sms, u, warps, splits, row_groups)
    return _run(x, w, w.shape[0], c, out_f32, p, p.kernel, pf)


def skinny_gemm_frag_cuda(x: torch.Tensor, wf: torch.Tensor, n: int, c: torch.Tensor | None, out_f32: bool,
                          pf: bool | None = None) -> torch.Tensor:
    """skinny_gemm_cuda's product with the weight in fragment order (fragment_order.to_fragment_order of w [n, k]:
    wf [ceil(n / 16), k / 32, 2, 32, 8], contiguous, on x's device): the `_frag` kernel of the same plan, whose warps
    read 512 contiguous bytes per load; the same bits as the row-major kernel.  One token tile (t <= 8) only: its
    plan is one row group per CTA at U = 8, the variant compiled."""
    t, k = x.shape
    if wf.dim() != 5 or tuple(wf.shape) != (-(-n // ROWS), k // BLOCK_K, 2, 32, 8) or wf.dtype != x.dtype \
            or not wf.is_contiguous() or wf.device != x.device:
        raise ValueError(f"skinny_gemm_frag: wf must be contiguous {x.dtype} [{-(-n // ROWS)}, {k // BLOCK_K}, 2, 32, "
                         f"8] on {x.device} for n {n}, k {k}, got {wf.dtype} {list(wf.shape)} on {wf.device}")
    p = plan(t, n, k, out_f32, c is not None, device_facts(x.device).sms)
    if (token_tiles(t), p.row_groups) != (1, 1) or not p.kernel.startswith("kdtree_skinny_gemm_t1_u8_"):
        raise ValueError(f"skinny_gemm_frag: only one token tile at U = 8 is compiled (t <= 8), got t {t} ({p.kernel})")
    return _run(x, wf, n, c, out_f32, p, p.kernel + "_frag", pf)


def _run(x: torch.Tensor, w: torch.Tensor, n: int, c: torch.Tensor | None, out_f32: bool, p: Plan, kernel: str,
         pf: bool | None) -> torch.Tensor:
    """One launch of `kernel` with plan p: y [t, n] (w row-major [n, k], or in fragment order for a _frag kernel)."""
    t, k = x.shape
    y = torch.empty(t, n, dtype=torch.float32 if out_f32 else torch.bfloat16, device=x.device)
    mod = _module(x.device)
    cu = mod.cu
    # a plan's dynamic shared memory reaches 64 KB (W = 16, RG = 2, TT = 4: forced, the default pairs groups only at
    # W <= 8): the kernel's ceiling set to the most any plan of it asks
    func = mod.funcs.get(kernel, (MAX_WARPS * p.row_groups * token_tiles(t) * 128 + 1) * 4)
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    args = (x.data_ptr(), w.data_ptr(), y.data_ptr(), c.data_ptr() if c is not None else 0, mod.parts.data_ptr(),
            mod.tickets.data_ptr(), t, n, k, x.stride(0), y.stride(0), c.stride(0) if c is not None else 0, p.splits,
            FLAG_PREFETCH * bool(prefetch_for(p) if pf is None else pf) | FLAG_LATE_TRIGGER * LATE_TRIGGER
            | FLAG_EARLY_WEIGHTS * EARLY_WEIGHTS)
    types = (ptr, ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i32, i32, i32, i32, i32)
    stream = cu.CUstream(torch.cuda.current_stream(x.device).cuda_stream)
    launch(cu, func, p.grid, 32 * p.warps, p.smem, stream, args, types, mod.pdl, f"skinny_gemm: launch {kernel}",
           x.device.index)
    return y
