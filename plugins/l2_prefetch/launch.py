"""Launches of l2_prefetch.cu through the driver API on torch's current stream (capturable in a CUDA graph).

prefetch_l2(w): bulk-prefetch the bytes of tensor w into L2 (returns at once; the lines arrive later).
prefetch_regions_l2(ws): up to four tensors in one launch, a node of the decode round's PDL chain (the op).
spin(cycles): one thread busy for `cycles` SM clocks (the benchmark's stand-in for other work).
The cubin comes from the artifact, the kdtree cache or NVRTC/nvcc (plugins/common/cubin.py).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from plugins.common.cubin import load_module
from plugins.common.device import device_facts
from plugins.common.device_modules import PerDevice
from plugins.common.driver import checked, launch
from plugins.common.pdl import USE_PDL

SOURCE = Path(__file__).with_name("l2_prefetch.cu")
CHUNK = 64 << 10  # bytes per bulk prefetch request
THREADS = 128

REGIONS = 4  # kdtree_l2_prefetch_regions' parameters
KERNELS = ("kdtree_l2_prefetch", "kdtree_l2_prefetch_regions", "kdtree_spin")


class L2PrefetchWarning(UserWarning):
    """The l2_prefetch kernels could not be loaded on a device."""


_FUNCS: PerDevice[dict[str, object]] = PerDevice("l2_prefetch", L2PrefetchWarning)


def _load(dev: torch.device) -> dict[str, object]:
    """The kernels of l2_prefetch.cu's cubin loaded on dev (a CUDA device with an index), by name."""
    from cuda.bindings import driver as cu
    module, _ = load_module(SOURCE, dev, "l2_prefetch")
    return {n: checked(cu, cu.cuModuleGetFunction(module, n.encode()), f"l2_prefetch: {n}") for n in KERNELS}


def _func(device: torch.device, name: str):
    """(the driver module, kernel `name`) on `device`, loaded at the first call (which must not be inside a CUDA
    graph capture); RuntimeError naming why where the kernels do not load."""
    from cuda.bindings import driver as cu
    return cu, _FUNCS.require(device, _load)[name]


def _launch(device: torch.device, name: str, grid: int, threads: int, args: tuple, types: tuple) -> None:
    cu, func = _func(device, name)
    stream = cu.CUstream(torch.cuda.current_stream(device).cuda_stream)
    launch(cu, func, grid, threads, 0, stream, args, types, False, f"l2_prefetch: launch {name}")


def _nbytes(w: torch.Tensor, what: str, device: torch.device | None = None) -> int:
    """The bytes of w, a contiguous CUDA tensor (on `device` when given) whose address and size are multiples of 16
    (the bulk prefetch's alignment); ValueError naming `what` otherwise."""
    if not w.is_cuda or not w.is_contiguous() or (device is not None and w.device != device):
        raise ValueError(f"{what}: a contiguous CUDA tensor{f' on {device}' if device else ''}, got {w.device} "
                         f"contiguous={w.is_contiguous()}")
    nbytes = w.numel() * w.element_size()
    if nbytes % 16 or w.data_ptr() % 16:
        raise ValueError(f"{what}: addresses and sizes must be multiples of 16, got {nbytes} bytes")
    return nbytes


def prefetch_l2(w: torch.Tensor, chunk: int = CHUNK, evict_last: bool = False, threads: int = THREADS) -> None:
    """Bulk-prefetch the storage of the contiguous CUDA tensor w into L2 (a hint; no result depends on it);
    evict_last: with L2's evict-last policy (kept over lines streamed in after them).  One request of `chunk` bytes
    a thread, CTAs of `threads` (fewer threads and smaller chunks spread the requests over more SMs, whose copy
    engines issue them side by side), at most one CTA an SM."""
    nbytes = _nbytes(w, "prefetch_l2")
    if chunk % 16:
        raise ValueError(f"prefetch_l2: chunk ({chunk}) must be a multiple of 16")
    if not 1 <= threads <= 1024:
        raise ValueError(f"prefetch_l2: threads ({threads}) must be in [1, 1024]")
    if nbytes == 0:
        return
    requests = -(-nbytes // chunk)
    grid = min(-(-requests // threads), device_facts(w.device).sms)
    _launch(w.device, "kdtree_l2_prefetch", grid, threads, (w.data_ptr(), nbytes, chunk, int(evict_last)),
            (ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_uint, ctypes.c_int))


def prefetch_regions_l2(ws: list[torch.Tensor], chunk: int = CHUNK) -> None:
    """Bulk-prefetch up to four contiguous CUDA tensors of one device into L2 in one launch that, on sm_90+, goes
    with programmatic dependent launch: the requests go out while the previous kernel still runs, and the launch
    completes after it (a node of the decode round's PDL chain).  A hint: no result depends on it."""
    if not ws:
        return
    if len(ws) > REGIONS:
        raise ValueError(f"prefetch_regions_l2: at most {REGIONS} tensors per launch, got {len(ws)}")
    dev = ws[0].device
    sizes = [_nbytes(w, "prefetch_regions_l2", dev) for w in ws] + [0] * (REGIONS - len(ws))
    ptrs = [w.data_ptr() for w in ws] + [ws[0].data_ptr()] * (REGIONS - len(ws))
    requests = sum(-(-b // chunk) for b in sizes)
    cu, func = _func(dev, "kdtree_l2_prefetch_regions")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    pdl = USE_PDL and device_facts(dev).capability[0] >= 9  # plugins/common/driver.launch remembers a refusal
    args = (*(v for pair in zip(ptrs, sizes) for v in pair), chunk)
    types = (*(t for _ in range(REGIONS) for t in (ctypes.c_void_p, ctypes.c_ulonglong)), ctypes.c_uint)
    stream = cu.CUstream(torch.cuda.current_stream(dev).cuda_stream)
    launch(cu, func, max(1, -(-requests // THREADS)), THREADS, 0, stream, args, types, pdl,
           "l2_prefetch: launch kdtree_l2_prefetch_regions", index)


def spin(cycles: int, device: torch.device) -> None:
    """One thread of one CTA busy for `cycles` SM clocks on the current stream."""
    _launch(device, "kdtree_spin", 1, 1, (cycles,), (ctypes.c_longlong,))
