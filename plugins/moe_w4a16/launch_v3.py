"""Launcher of moe_w4a16 v3: experts in fragment order (fragment_layout.py), the GEMMs in CUDA C (moe_v3.cu).

route_kernel (Triton, as v2) -> gate_up (v3: h = silu(gate) * up per slot) -> down
(v3: the weighted expert output per slot) -> combine_kernel (Triton, as v2: y[tok] = sum of its local slots, in slot
order; it also re-zeroes the routing counts for the next call, so no memset precedes the route kernel).  Four
launches (three for one token with ONE_LAUNCH: gate_up and down in one grid, kdtree_moe_v3_one), no host sync,
capturable in a CUDA graph (the CUDA C kernels go through the driver API onto torch's current stream).  The cubin
comes from the artifact, the kdtree cache or NVRTC/nvcc (plugins/common/cubin.py).  CUDA, bf16 tokens and bf16
scales only (the op falls back elsewhere).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from core.env_flags import env_flag
from plugins.common.cubin import CubinUnavailable, load_module
from plugins.common.device import DeviceFacts, device_facts
from plugins.common.driver import Functions, launch, pdl_refused
from plugins.common.pdl import USE_PDL
import plugins.moe_w4a16.launch_wgmma as launch_wgmma
from plugins.moe_w4a16.fragment_layout import ROWS
from plugins.moe_w4a16.launch import launch_combine
from plugins.moe_w4a16.layout import GROUP, padded_k
from plugins.moe_w4a16.plan import cdiv, launch_plan
from plugins.moe_w4a16.route_kernel import launch_route
from plugins.moe_w4a16.workspace import MoEWorkspace

SOURCE = Path(__file__).with_name("moe_v3.cu")
# L2 prefetch of the expert weights inside gate_up / down (moe_v3.cu's `pf`): a hint, results are the same bits
# either way.  Off unless KDTREE_MOE_PREFETCH=1 (read at each call, so a benchmark can time both in one process): on
# the H200 (benchmarks/results/moe_w4a16_v3.json, K2.6 TP8, tree routing) it won only with the NT = 4 tile (t = 512:
# 529.7 -> 510.6 µs), which NT = 2 beats without it (472.8); with the tiles token_tile chooses it lost (t = 1 29.0
# against 28.9, t = 9 64.7 / 58.0, t = 17 58.6 / 51.5, t = 64 114.8 / 105.5).
# down's prefetch alone (each warp's next item into L2 while it streams the current one) was tried on 2026-12-06
# (H100, benchmarks/results/moe_w4a16_v3-h100.json before this change: t = 1 30.8 against 31.0 µs, t = 9 70.7 / 68.7,
# t = 17 59.6 / 58.5; the K2.6 rank at 40 layers AR -0.2 %, DDTree-16 +0.9 %) and removed.
PREFETCH_ENV = "KDTREE_MOE_PREFETCH"


def prefetch_on() -> bool:
    """Whether gate_up and down prefetch their experts into L2, from KDTREE_MOE_PREFETCH: unset / 0 no, 1 yes;
    anything else is a ValueError naming the variable."""
    value = os.environ.get(PREFETCH_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{PREFETCH_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


# Weights before the PDL wait (down_kernel's kdtree_moe_v3_down_early_*, combine_shared_kernel's EARLY): down builds
# its entry list and prefetches its first P groups of weights and scales (a whole item at TP8) into L2 while gate_up
# runs, its ring's loads after the wait; the combine forms the shared expert's down product (h is the route kernel's)
# before waiting for down.  The same bits either way (tests/test_moe_v3_gpu.py).  Measured on (2026-12-05, H100,
# K2.6 TP8 rank at 40 layers, benchmarks/results/k26-switches-h100.json: AR step -2.8 %, DDTree rounds -3.6 %), but
# with the down of then, which loaded the weights into registers and whose first h loads ptxas had hoisted above
# the wait (.nc): a race with gate_up's stores, fixed 2026-12-06 (moe_v3.cu: h through .cg).  The prefetching down
# that replaced it, measured 2026-12-06 (H100, 40 layers, benchmarks/results/k26-switches-h100.json): AR step 3569
# against 3602 µs without it (-0.9 %), DDTree-16 round 6193 against 6271 (-1.2 %).
EARLY_WEIGHTS = True
WARPS = 8  # moe_v3.cu's WARPS: every k group count is a multiple (k padded to 256)
MAX_TOKENS = 4096  # per launch: the entry list of 4096 tokens x top-8 fits in shared memory


def token_tile(t: int) -> int:
    """NT: n tiles of 8 token slots per gate_up tile, from t (tree routing sends most tokens to a few experts).
    A DDTree round verifies budget + 1 tokens, and most of its experts see a few of them, so small tiles win: on the
    H200 under tree routing (benchmarks/results/moe_w4a16_v3.json, K2.6 TP8, the same bits either way) NT = 1 beat
    NT = 2 at t = 9 (57.9 against 66.0 µs) and t = 17 (51.5 against 57.3), NT = 2 beat NT = 4 at t = 64 (105.5
    against 139.4) and t = 512 (472.8 against 529.7).  NT = 4 stays for the benchmark's comparison
    (TOKEN_TILE_OVERRIDE)."""
    return 1 if t <= 17 else 2


def down_tile(nt: int) -> int:
    """The down kernel's NT for gate_up's: at most 2 (its variants)."""
    return min(nt, 2)


GATE_UP_P = {1: (7, 4, 2, 1), 2: (4, 2, 1), 4: (2, 1)}  # ring depths compiled per NT (moe_v3.cu's variants)
GATE_UP_CTAS_PER_SM = {1: 2, 2: 2, 4: 1}
W16 = 16  # warps of moe_v3.cu's gate_up_w16 variants: one 512-thread CTA per SM
GATE_UP_W16_P = {1: 7}  # their (NT, ring depth)
# gate_up_w16 where it applies (benchmarks/moe_w4a16_v3.py times it against the 8-warp kernel).  On: the K2.6 rank
# (k26-switches-h100.json, H100, 40 layers, 2026-12-06, after the token loads' moves went) AR step -1.2 % against the
# 8-warp gate_up, -3.6 % with the glue kernels' early weights beside it; DDTree rounds never take it (t = 1 only).
# The op alone still measures it level or slower (t = 1: 31.3 against 30.8 µs): in the round its CTAs start under
# the predecessor's tail and down's early CTAs find no room either way
USE_W16 = True
# KDTREE_MOE_ONE_TOKEN (on; =0 turns it off; k26_switches moe_one): the 16-warp gate_up at t = 1 takes token 0 for
# each entry's one position instead of reading the lists through stage_slots (moe_v3.cu's PF_ONE), so its first
# weight and token loads follow the entry list without that round trip; the same bits.  Predicted (the AR step's
# gate_up, one L2 round trip and a CTA barrier): -0.5 .. -0.8 µs a layer, AR step ~-0.8 %, DDTree rounds unchanged;
# measured (H100, K2.6 rank at 40 layers, 4K; k26-switches-h100.json call 21): AR step -1.3 %, DDTree-16 level.
ONE_TOKEN = env_flag("KDTREE_MOE_ONE_TOKEN", True)
# KDTREE_MOE_ONE_LAUNCH (on; =0 turns it off; k26_switches moe_one_launch): at t = 1 gate_up and down in one launch
# (moe_v3.cu's kdtree_moe_v3_one, one_launch_applies): down's weights copied into shared memory while gate_up streams,
# its math after a per-pick counter says the pick's h row is whole, instead of a second grid that can start only when
# gate_up's CTAs leave their SMs.  The same h and out bits as the two kernels (tests/test_moe_v3_gpu.py).  Its waits
# need every CTA resident at once: not taken under MPS with an SM share (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE < 100).
# Measured with ONE_SHARED (H100, K2.6 rank at 40 layers, 4K; k26-switches-h100.json): AR step -2.7 %, DDTree level.
ONE_LAUNCH = env_flag("KDTREE_MOE_ONE_LAUNCH", True)
# KDTREE_MOE_ONE_SHARED (on; only with ONE_LAUNCH; k26_switches moe_one_shared): the one-token grid also forms the
# shared expert's down product (fp32, into the workspace's shared_f) while its CTAs wait for each other, and the
# combine only adds it: measured with ONE_LAUNCH alone (H100, 40 layers, k26-switches-h100.json), the combine's own
# product could not start before the grid left the SMs (combine 2.85 -> 4.75 µs a layer, AR step level).
ONE_SHARED = env_flag("KDTREE_MOE_ONE_SHARED", True)
# KDTREE_MOE_ONE_COMBINE=1 (off until measured; with ONE_LAUNCH; k26_switches moe_one_combine): the one-token grid
# also does the combine (the last of a row pair's top_k CTAs sums its rows into y, moe_v3.cu's one_combine_rows; the
# same bits as the combine kernel) and re-zeroes the routing counts: no combine launch.  Taken where the grid forms
# the shared product (ONE_SHARED) or there is no shared expert.
ONE_COMBINE = env_flag("KDTREE_MOE_ONE_COMBINE", False)
ONE_SMEM_MAX = 227 * 1024 - 64  # the SM's 227 KB a CTA, less kdtree_moe_v3_one's static shared int (and slack)
# NT for every t (1, 2 or 4; down takes min(NT, 2)): the benchmark's other choice; None: token_tile(t)
TOKEN_TILE_OVERRIDE: int | None = None
DOWN_P = {1: 8, 2: 4}


def gate_up_variant(nt: int, n_groups: int) -> str:
    """The kernel for NT token tiles and n_groups k groups (kp_d / 32): the deepest ring P dividing the groups
    each warp takes (n_groups / 8), so that a chunk of P groups never straddles two items."""
    per_warp = n_groups // WARPS
    p = next(p for p in GATE_UP_P[nt] if per_warp % p == 0)
    return f"kdtree_moe_v3_gate_up_nt{nt}_p{p}"


def gate_up_w16(nt: int, n_groups: int, n_items: int, sms: int) -> str | None:
    """The 16-warp gate_up where the items (at most n_items) barely exceed the SMs (t = 1: 8 experts x 16 row pairs,
    144 at most on 132 SMs): one CTA of 16 warps per SM, against two 8-warp CTAs of which the items fill one, so
    twice the warps per SM keep loads in flight (Nsight: issue / latency bound at 8 warps per SM).  None where it
    does not apply: more items, another NT, or k groups that 16 warps x the ring depth do not divide."""
    p = GATE_UP_W16_P.get(nt)
    if p is None or n_items > sms + sms // 4 or n_groups % (W16 * p):
        return None
    return f"kdtree_moe_v3_gate_up_w16_nt{nt}_p{p}"


def gate_up_kernel(nt: int, n_groups: int, n_items: int, sms: int) -> tuple[str, int]:
    """(kernel, warps) of the plain gate_up: the 16-warp CTA where gate_up_w16 applies (and USE_W16), else the
    8-warp kernel with the deepest ring (gate_up_variant)."""
    name = gate_up_w16(nt, n_groups, n_items, sms) if USE_W16 else None
    return (name, W16) if name is not None else (gate_up_variant(nt, n_groups), WARPS)


def one_smem(c2: int, sd_rows: int = 0, i_s: int = 0) -> int:
    """kdtree_moe_v3_one's shared memory: the warps' partial sums [16][2][4][32] fp32, h staged [8][16] bf16, down's
    rows staged [16][8][32] bf16, down's words [16][c2][32] uint4 and scales [16][c2][32] uint2, and the shared
    expert's weight rows [sd_rows][i_s] bf16 (ONE_SHARED)."""
    return W16 * 256 * 4 + 8 * 16 * 2 + W16 * 8 * 32 * 2 + W16 * c2 * 32 * (16 + 8) + sd_rows * i_s * 2


def one_shared_rows(top_k: int, pairs13: int, pairs2: int, c2: int, x: torch.Tensor, shared_h: torch.Tensor | None,
                    shared_down: torch.Tensor | None, by_pair: bool = False) -> int:
    """Rows of the shared expert's down product each CTA of kdtree_moe_v3_one forms (ONE_SHARED): d over the grid, or
    (by_pair: with ONE_COMBINE) a top_k-th of the rows of the down row pairs its warps take (p, p + pairs13, ...: at
    most 32 cdiv(pairs2, pairs13)); 0 where the combine forms it: bf16 shared_h [1, i'] and shared_down [d, i'] with
    contiguous rows, i' % 8 == 0 and 16-byte aligned (the kernel reads both in 16-byte pieces), and the rows'
    weights within the SM's shared memory."""
    if not ONE_SHARED or shared_h is None or shared_down is None:
        return 0
    d, i_s = shared_down.shape
    rows = cdiv(32 * cdiv(pairs2, pairs13), top_k) if by_pair else cdiv(d, top_k * pairs13)
    ok = (shared_h.dtype == shared_down.dtype == torch.bfloat16 and shared_h.dim() == 2 and shared_h.shape[1] == i_s
          and shared_h.stride(1) == 1 and shared_down.is_contiguous() and d == x.shape[1] and i_s % 8 == 0
          and shared_h.data_ptr() % 16 == 0 and shared_down.data_ptr() % 16 == 0
          and one_smem(c2, rows, i_s) <= ONE_SMEM_MAX)
    return rows if ok else 0


def _mps_share() -> bool:
    """Whether this process runs under MPS with a share of the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE below 100):
    then fewer SMs than the device's may hold its CTAs, and kdtree_moe_v3_one's waits need all of them at once."""
    value = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "").strip()
    try:
        return bool(value) and float(value) < 100
    except ValueError:
        return True  # unreadable: assume a share


def one_launch_applies(t: int, top_k: int, pairs13: int, c1: int, pairs2: int, c2: int, facts: DeviceFacts) -> bool:
    """Whether kdtree_moe_v3_one takes this call (ONE_LAUNCH on): one token on a Hopper GPU (sm_90: the GPU it was
    written for, whose SM holds its ~123 KB of shared memory); a CTA per (pick, w13 row pair), all resident at once
    (at most the SMs: its waits need every CTA running); 16 warps x the ring depth dividing the k groups; down's row
    pairs one a warp of the pick's CTAs; not under MPS with an SM share (_mps_share)."""
    return (ONE_LAUNCH and t == 1 and facts.arch == "sm_90" and top_k * pairs13 <= facts.sms and not _mps_share()
            and c1 % (W16 * GATE_UP_W16_P[1]) == 0 and pairs2 <= W16 * pairs13 and one_smem(c2) <= ONE_SMEM_MAX)


def down_kernel(nt: int) -> str:
    """down's variant for NT: with EARLY_WEIGHTS the one that prefetches its first weights before its PDL wait
    (moe_v3.cu's kdtree_moe_v3_down_early_*), else the one that waits first."""
    return f"kdtree_moe_v3_down{'_early' if EARLY_WEIGHTS else ''}_nt{nt}_p{DOWN_P[nt]}"


def max_entries(t: int, top_k: int, e_local: int, nt: int) -> int:
    """Bound on (expert, token tile) entries: each active expert's last tile may be partial."""
    return min(e_local, t * top_k) + cdiv(t * top_k, 8 * nt)


# The entries' slot ids (and down's routing weights) staged in shared memory at the start (moe_v3.cu's stage_slots),
# where an item's setup loaded them from L2 and used them at once (ncu, down at t = 17 on the H100: the warps stalled
# there): up to this many bytes per CTA, i.e. the rounds of a DDTree verify up to ~30 tokens at NT = 1; above, the
# kernels load them per item as before (they read the room from the launch's dynamic shared memory size).
# KDTREE_MOE_STAGE=0: no staging (the per-item loads everywhere)
STAGE_MAX_BYTES = (16 << 10) if env_flag("KDTREE_MOE_STAGE", True) else 0


def _stage_bytes(t: int, top_k: int, e_local: int, nt: int, per_slot: int) -> int:
    n = max_entries(t, top_k, e_local, nt) * 8 * nt * per_slot
    return n if n <= STAGE_MAX_BYTES else 0


def gate_up_smem(t: int, top_k: int, e_local: int, nt: int, warps: int = WARPS) -> int:
    """reduction [2][warps][2][nt][4][32] fp32 + h rows staged [8 nt][16] bf16 + entry list + staged slots."""
    return (2 * warps * (2 * nt * 4 * 32) * 4 + 8 * nt * 16 * 2
            + (warps + e_local + max_entries(t, top_k, e_local, nt)) * 4 + _stage_bytes(t, top_k, e_local, nt, 4))


def down_smem(t: int, top_k: int, e_local: int, nt: int) -> int:
    """out rows staged [8 warps][8 nt][32] bf16 + entry list + staged slots and their routing weights."""
    return (WARPS * 8 * nt * 32 * 2 + (WARPS + e_local + max_entries(t, top_k, e_local, nt)) * 4
            + _stage_bytes(t, top_k, e_local, nt, 8))


@dataclass
class _Module:
    cu: object
    funcs: Functions  # the loaded cubin's kernels
    index: int  # the CUDA device's
    where: str  # which cubin was loaded (plugins/common/cubin.load_module: artifact, cache or compiled)
    pdl: bool = False  # ask for programmatic dependent launch (sm_90+; driver.launch remembers a refusal)


_MODULES: dict[int, _Module] = {}


PF_L2, PF_ONE = 1, 2  # moe_v3.cu's bits of `pf`


def kernels(device: torch.device) -> _Module:
    """The loaded moe_v3 module of `device` (loaded once per device).  Its cubin is always of the current moe_v3.cu
    (plugins/common/cubin.py: an artifact's only where its recorded source_sha256 matches, the cache keyed by the
    source's hash), so every kernel launch_v3 names is in it, waits for its predecessor and takes `pf`."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    mod = _MODULES.get(index)
    if mod is None:
        from cuda.bindings import driver as cu
        module, where = load_module(SOURCE, torch.device("cuda", index), "moe_w4a16 v3")
        pdl = USE_PDL and device_facts(device).capability[0] >= 9
        mod = _MODULES[index] = _Module(cu, Functions(cu, module, f"moe_w4a16 v3 ({where})"), index, where, pdl)
    return mod


_UNAVAILABLE: dict[int, str] = {}  # device index -> why v3 does not load there (a failure is final per process)


def unavailable(device: torch.device) -> str | None:
    """None when the v3 kernels load on `device` (a CUDA device), else why not (one line: no cubin for its arch
    and neither NVRTC nor nvcc to compile one, no cuda-python, or the driver refused the module).  A failure is
    remembered per device, so asking again (every MoE layer of a load) tries no compiler twice."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _UNAVAILABLE and index not in _MODULES:
        try:
            kernels(device)
        except (CubinUnavailable, ImportError, RuntimeError) as exc:
            _UNAVAILABLE[index] = f"{type(exc).__name__}: {exc}"
    return _UNAVAILABLE.get(index)


def _launch(mod: _Module, name: str, grid: int, smem: int, args: tuple, types: tuple, warps: int = WARPS) -> None:
    """One launch on torch's current stream; with mod.pdl through cuLaunchKernelEx with programmatic stream
    serialization (the kernels wait for their predecessor grid first: moe_v3.cu's pdl_prologue).  A refused
    attribute turns PDL off for the device (plain launches from then on, this one included)."""
    cu = mod.cu
    stream = cu.CUstream(torch.cuda.current_stream().cuda_stream)
    launch(cu, mod.funcs.get(name, smem), grid, 32 * warps, smem, stream, args, types, mod.pdl,
           f"moe_w4a16 v3: launch {name}", mod.index)


def check_fragments(x: torch.Tensor, logits: torch.Tensor, bias: torch.Tensor, w13: torch.Tensor,
                    w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, top_k: int,
                    e_start: int) -> None:
    """ValueError naming the tensor when the inputs do not fit v3 (the kernels read every size from these
    shapes: a wrong one would read out of bounds)."""
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.shape[1] % GROUP:
        raise ValueError(f"moe_w4a16 v3: x must be bf16 [t, d] with d % {GROUP} == 0, got {x.dtype} {list(x.shape)}")
    t, d = x.shape
    if logits.dim() != 2 or logits.shape[0] != t or logits.dtype != torch.float32:
        raise ValueError(f"moe_w4a16 v3: logits must be fp32 [{t}, e], got {logits.dtype} {list(logits.shape)}")
    e = logits.shape[1]
    if tuple(bias.shape) != (e,):
        raise ValueError(f"moe_w4a16 v3: bias must be [{e}], got {list(bias.shape)}")
    if w13.dim() != 5 or w13.shape[1] % 2:
        raise ValueError(f"moe_w4a16 v3: w13 must be fragment order [e_l, 2i/32, kp_d/32, 32, 4], got "
                         f"{list(w13.shape)}")
    e_local, pairs13 = w13.shape[:2]
    i = pairs13 * ROWS // 2
    kd, ki = padded_k(d) // GROUP, padded_k(i) // GROUP
    want = {"w13": (w13, (e_local, pairs13, kd, 32, 4), torch.int32),
            "w13_scale": (w13_scale, (e_local, pairs13, kd, 8, 4), torch.bfloat16),
            "w2": (w2, (e_local, d // ROWS, ki, 32, 4), torch.int32),
            "w2_scale": (w2_scale, (e_local, d // ROWS, ki, 8, 4), torch.bfloat16)}
    for name, (ten, shape, dtype) in want.items():
        if tuple(ten.shape) != shape or ten.dtype != dtype or not ten.is_contiguous():
            raise ValueError(f"moe_w4a16 v3: {name} must be contiguous {dtype} {list(shape)} (d {d}, i {i}), got "
                             f"{ten.dtype} {list(ten.shape)}")
    if i % GROUP or d % ROWS:
        raise ValueError(f"moe_w4a16 v3: d ({d}) and i ({i}) must be multiples of {ROWS}")
    if not 1 <= top_k <= e or not 0 <= e_start <= e - e_local:
        raise ValueError(f"moe_w4a16 v3: top_k {top_k} of {e} experts, local experts [{e_start}, "
                         f"{e_start + e_local}) outside [0, {e})")


def moe_w4a16_v3(x: torch.Tensor, logits: torch.Tensor, bias: torch.Tensor, w13: torch.Tensor,
                 w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, top_k: int, n_group: int,
                 topk_group: int, norm_topk_prob: bool, scaling: float, e_start: int = 0,
                 workspace: torch.Tensor | None = None, shared_gate_up: torch.Tensor | None = None,
                 shared_h: torch.Tensor | None = None, shared_down: torch.Tensor | None = None) -> torch.Tensor:
    """Routed experts of one MoE layer: x [t, d] bf16, logits [t, e] fp32 -> y [t, d] bf16.

    Experts in fragment order: w13 int32 [e_l, 2i/32, kp_d/32, 32, 4], w13_scale bf16 [e_l, 2i/32, kp_d/32, 8, 4],
    w2 int32 [e_l, d/32, kp_i/32, 32, 4], w2_scale bf16 [e_l, d/32, kp_i/32, 8, 4].  workspace: as v2 (a
    MoEWorkspace's .buffer sized by launch_plan), or None to allocate the scratch per call.  shared_gate_up /
    shared_h / shared_down: as v2 (the routing kernel also writes the shared expert's silu(gate) * up, the
    combine adds its down projection).
    """
    x = x.contiguous()
    logits = logits if logits.dim() == 2 and logits.stride(1) == 1 else logits.contiguous()  # rows may be strided
    check_fragments(x, logits, bias, w13, w13_scale, w2, w2_scale, top_k, e_start)
    t, d = x.shape
    if t > MAX_TOKENS:  # the entry lists live in shared memory: longer inputs go in pieces (rows are independent)
        return torch.cat([moe_w4a16_v3(x[a:a + MAX_TOKENS], logits[a:a + MAX_TOKENS], bias, w13, w13_scale, w2,
                                       w2_scale, top_k, n_group, topk_group, norm_topk_prob, scaling, e_start,
                                       workspace, *(None if s is None else s[a:a + MAX_TOKENS]
                                                    for s in (shared_gate_up, shared_h)), shared_down)
                          for a in range(0, t, MAX_TOKENS)])
    e_local, pairs13, c1 = w13.shape[:3]
    pairs2, c2 = w2.shape[1:3]
    i = pairs13 * ROWS // 2
    y = torch.empty_like(x)
    if t == 0:
        return y
    if workspace is None:
        workspace = torch.zeros(MoEWorkspace.nbytes(t, top_k, e_local, d, i, x.dtype, x.device),
                                dtype=torch.uint8, device=x.device)  # zero counts (workspace.py)
    ws = MoEWorkspace.carve(workspace, t, top_k, e_local, d, i, x.dtype,
                            launch_plan(t, top_k, e_local, d, i, x.device).splits)
    mod = kernels(x.device)  # before the route kernel: a failure here leaves counts zero
    pf_on = prefetch_on()  # before the route kernel too (a bad KDTREE_MOE_PREFETCH raises with counts zero)
    wgmma = launch_wgmma.applies(t, x.device, pairs13, c1, pairs2, c2)  # before the route kernel (it may load)
    # counts [e_local + 1] is zero here (MoEWorkspace.allocate zeroes it, every call's combine re-zeroes it)
    launch_route(logits, bias, ws.topk_idx, ws.topk_w, ws.counts, ws.active, ws.lists, e_start, e_local,
                 scaling, top_k, n_group, topk_group, norm_topk_prob, shared_gate_up, shared_h, active_list=False)
    facts = device_facts(x.device)
    sms = facts.sms
    i32, ptr = ctypes.c_int, ctypes.c_void_p
    if wgmma:  # many tokens an expert: moe_wgmma.cu's two GEMMs (launch_wgmma.py), the same h and out
        launch_wgmma.gate_up(w13, w13_scale, x, ws.counts, ws.lists, ws.h, t, top_k, e_local, i)
        launch_wgmma.down(w2, w2_scale, ws.h, ws.topk_w, ws.counts, ws.lists, ws.out, t, top_k, e_local, i)
    elif one_launch_applies(t, top_k, pairs13, c1, pairs2, c2, facts):  # one token: both GEMMs in one grid
        # the shared product too (rows by row pair with the combine), and the combine
        sd_rows = one_shared_rows(top_k, pairs13, pairs2, c2, x, shared_h, shared_down, ONE_COMBINE)
        combine = ONE_COMBINE and (sd_rows > 0 or shared_down is None)
        i_s = shared_down.shape[1] if sd_rows else 0
        _launch(mod, "kdtree_moe_v3_one", top_k * pairs13, one_smem(c2, sd_rows, i_s),
                (w13.data_ptr(), w13_scale.data_ptr(), w2.data_ptr(), w2_scale.data_ptr(), x.data_ptr(),
                 ws.topk_idx.data_ptr(), ws.topk_w.data_ptr(), ws.h.data_ptr(), ws.out.data_ptr(), ws.sync.data_ptr(),
                 top_k, e_start, e_local, d // GROUP, c1, pairs13, i, i // GROUP, c2, pairs2, d,
                 shared_down.data_ptr() if sd_rows else 0, shared_h.data_ptr() if sd_rows else 0,
                 ws.shared_f.data_ptr(), i_s, sd_rows, y.data_ptr() if combine else 0, ws.counts.data_ptr()),
                (ptr,) * 10 + (i32,) * 11 + (ptr,) * 3 + (i32,) * 2 + (ptr,) * 2, W16)
        if combine:  # y is written, the counts zeroed
            return y
        if sd_rows:  # the combine adds the grid's product
            launch_combine(ws.out, ws.topk_idx, y, ws.counts, e_start, e_local, top_k,
                           mod.pdl and not pdl_refused(mod.index), shared_f=ws.shared_f.view(1, d))
            return y
    else:
        pf = ((PF_L2 * pf_on | PF_ONE * ONE_TOKEN,), (i32,))  # the flags argument (values, ctypes) of both
        nt = TOKEN_TILE_OVERRIDE or token_tile(t)
        n_items = max_entries(t, top_k, e_local, nt) * pairs13
        args = (w13.data_ptr(), w13_scale.data_ptr(), x.data_ptr(), ws.counts.data_ptr(), ws.lists.data_ptr(),
                ws.h.data_ptr(), t, top_k, e_local, d // GROUP, c1, pairs13, i, *pf[0])
        types = (ptr, ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i32, i32, i32, i32, *pf[1])
        name, warps = gate_up_kernel(nt, c1, n_items, sms)
        smem = gate_up_smem(t, top_k, e_local, nt, warps)
        # one 16-warp CTA per SM, or GATE_UP_CTAS_PER_SM[nt] of 8 warps
        _launch(mod, name, min(n_items, sms if warps == W16 else GATE_UP_CTAS_PER_SM[nt] * sms), smem, args, types,
                warps)
        nt2 = down_tile(nt)
        n_items = max_entries(t, top_k, e_local, nt2) * pairs2
        smem = down_smem(t, top_k, e_local, nt2)
        _launch(mod, down_kernel(nt2), min(cdiv(n_items, WARPS), 2 * sms), smem,
                (w2.data_ptr(), w2_scale.data_ptr(), ws.h.data_ptr(), ws.topk_w.data_ptr(), ws.counts.data_ptr(),
                 ws.lists.data_ptr(), ws.out.data_ptr(), t, e_local, i // GROUP, c2, pairs2, d, *pf[0]),
                (ptr, ptr, ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i32, i32, i32, *pf[1]))
    launch_combine(ws.out, ws.topk_idx, y, ws.counts, e_start, e_local, top_k, mod.pdl and not pdl_refused(mod.index),
                   shared_h, shared_down, early=EARLY_WEIGHTS)
    return y
