"""Launcher of skinny_gemm.cu: the plan (variant, warps W, k splits KS) and one launch through the driver API on torch's
current stream (capturable in a CUDA graph; PDL on sm_90+).  See skinny_gemm.cu for the algorithm.

The plan depends on (n, k, the device's SM count) for W and KS, and on t only for the token tiles TT: so the order in
which an output element is summed does not depend on t, and a token's row is the same bits in an AR step and in a
tree round.  The cubin comes from the artifact, the kdtree cache or NVRTC/nvcc (plugins/common/cubin.py).
"""

from __future__ import annotations

import ctypes
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from plugins.common.cubin import CubinUnavailable, load_module
from plugins.common.device import device_facts
from plugins.common.driver import checked, launch
from plugins.common.pdl import USE_PDL

SOURCE = Path(__file__).with_name("skinny_gemm.cu")
MAX_TOKENS = 32  # TT = 4 tiles of 8 tokens: more tokens are cuBLAS's (compute starts to matter)
ROWS = 16  # weight rows per CTA (mma's M)
BLOCK_K = 32  # k columns per block (two mma k steps)
MAX_WARPS = 16  # 512 threads per CTA (skinny_gemm.cu's launch bounds)
WARPS_PER_SM = 16  # the plan's target of resident warps per SM (<= 128 registers each: a whole SM at 16)
# blocks in flight per warp (1 KB of weights each), per token tile count: the compiled variants, the plan's first
# (the deepest that fits 128 registers without spilling; benchmarks/skinny_gemm.py's sweep times the other)
U_VARIANTS = {1: (8, 4), 2: (6, 4), 4: (4, 2)}
PARTS_FLOATS = 1 << 20  # the per-device split-k workspace: partial tiles (4 MB) ...
TICKETS = 4096  # ... and one ticket counter per row group (a plan with KS > 1 has fewer groups than SMs)
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
# Off until measured (benchmarks/k26_switches.py skinny_early, benchmarks/skinny_gemm.py); an older cubin ignores it
EARLY_WEIGHTS = False
FLAG_PREFETCH, FLAG_LATE_TRIGGER, FLAG_EARLY_WEIGHTS = 1, 2, 4  # skinny_gemm.cu's flags
# weights larger than this stay cuBLAS's: the lm_head slice (294 MB at K2.6 TP8) already runs at 93 % of HBM there
MAX_WEIGHT_BYTES = 128 << 20


@dataclass(frozen=True)
class Plan:
    kernel: str  # skinny_gemm.cu's function name
    warps: int  # W: warps per CTA, splitting the CTA's k range
    splits: int  # KS: CTAs per row group, splitting k
    groups: int  # row groups of 16 weight rows
    smem: int  # dynamic shared memory bytes

    @property
    def grid(self) -> tuple[int, int]:
        return self.groups, self.splits


def token_tiles(t: int) -> int:
    return 1 if t <= 8 else 2 if t <= 16 else 4


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
         warps: int | None = None, splits: int | None = None) -> Plan:
    """The launch for x [t, k] . w [n, k]^T; u / warps / splits override the choice (benchmark sweeps, tests)."""
    tt = token_tiles(t)
    w, ks = split_shape(n, k, sms)
    w, ks, u = warps or w, splits or ks, u or U_VARIANTS[tt][0]
    groups = -(-n // ROWS)
    if ks > 1 and (groups > TICKETS or groups * ks * tt * 128 > PARTS_FLOATS):
        raise ValueError(f"skinny_gemm: {ks} k splits of {groups} row groups exceed the split workspace")
    name = f"kdtree_skinny_gemm_t{tt}_u{u}_" + ("f32" if out_f32 else "bf16_c" if add_c else "bf16")
    return Plan(name, w, ks, groups, (w * tt * 128 + 1) * 4)


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


_UNAVAILABLE: dict[int, str] = {}  # device index -> why the module does not load there (final per process)


def available(device: torch.device) -> bool:
    """Whether the kernels load on `device` (loading them at the first ask); one SkinnyGemmWarning, naming why, when
    they do not (no cubin for the arch and no compiler, no cuda-python, the driver refused the module).  Asked first
    inside a CUDA graph capture, False without loading (the runtime's warm-up calls come before any capture)."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _MODULES:
        return True
    if index in _UNAVAILABLE or torch.cuda.is_current_stream_capturing():
        return False
    try:
        _module(device)
    except (CubinUnavailable, ImportError, RuntimeError) as exc:
        _UNAVAILABLE[index] = f"{type(exc).__name__}: {exc}"
        warnings.warn(SkinnyGemmWarning(f"skinny_gemm unavailable on cuda:{index} ({_UNAVAILABLE[index]}); the "
                                        f"few-token GEMMs stay cuBLAS's"), stacklevel=2)
        return False
    return True


@dataclass
class _Module:
    """One device's loaded kernels and split-k workspace.  The workspace serves the calls of one stream at a time
    (each call's last CTAs leave its tickets zero for the next): the decode round's, eager or replayed."""
    cu: object
    module: object
    funcs: dict  # kernel name -> CUfunction
    pdl: bool  # ask for PDL (sm_90+ and KDTREE_PDL; plugins/common/driver.launch remembers a refusal)
    parts: torch.Tensor  # [PARTS_FLOATS] fp32
    tickets: torch.Tensor  # [TICKETS] int32, zero between calls


_MODULES: dict[int, _Module] = {}


def _module(device: torch.device) -> _Module:
    """The loaded module and split workspace of `device`, made at its first call, which must not be inside a CUDA
    graph capture (the workspace would live in the capture's pool): the runtime's warm-up calls come first."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    mod = _MODULES.get(index)
    if mod is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("skinny_gemm: first call inside a CUDA graph capture; call it once before capturing")
        from cuda.bindings import driver as cu
        dev = torch.device("cuda", index)
        module, _ = load_module(SOURCE, dev, "skinny_gemm")
        mod = _MODULES[index] = _Module(cu, module, {}, USE_PDL and device_facts(dev).capability[0] >= 9,
                                        torch.empty(PARTS_FLOATS, dtype=torch.float32, device=dev),
                                        torch.zeros(TICKETS, dtype=torch.int32, device=dev))
    return mod


def skinny_gemm_cuda(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor | None, out_f32: bool, pf: bool | None = None,
                     u: int | None = None, warps: int | None = None, splits: int | None = None) -> torch.Tensor:
    """y [t, n] = x [t, k] . w [n, k]^T (+ c), fp32 accumulation, bf16 (or fp32 with out_f32) out; the inputs as
    supports() takes them.  pf: L2-prefetch each CTA's weights first (before the PDL wait); None: PREFETCH's choice."""
    t, k = x.shape
    n = w.shape[0]
    y = torch.empty(t, n, dtype=torch.float32 if out_f32 else torch.bfloat16, device=x.device)
    p = plan(t, n, k, out_f32, c is not None, device_facts(x.device).sms, u, warps, splits)
    mod = _module(x.device)
    cu = mod.cu
    func = mod.funcs.get(p.kernel)
    if func is None:
        func = mod.funcs[p.kernel] = checked(cu, cu.cuModuleGetFunction(mod.module, p.kernel.encode()),
                                             f"skinny_gemm: cuModuleGetFunction {p.kernel}")
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    args = (x.data_ptr(), w.data_ptr(), y.data_ptr(), c.data_ptr() if c is not None else 0, mod.parts.data_ptr(),
            mod.tickets.data_ptr(), t, n, k, x.stride(0), y.stride(0), c.stride(0) if c is not None else 0, p.splits,
            FLAG_PREFETCH * bool(prefetch_for(p) if pf is None else pf) | FLAG_LATE_TRIGGER * LATE_TRIGGER
            | FLAG_EARLY_WEIGHTS * EARLY_WEIGHTS)
    types = (ptr, ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i32, i32, i32, i32, i32)
    stream = cu.CUstream(torch.cuda.current_stream(x.device).cuda_stream)
    launch(cu, func, p.grid, 32 * p.warps, p.smem, stream, args, types, mod.pdl, f"skinny_gemm: launch {p.kernel}",
           x.device.index)
    return y
