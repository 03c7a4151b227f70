"""Launches of l2_prefetch.cu through the driver API on torch's current stream (capturable in a CUDA graph).

prefetch_l2(w): bulk-prefetch the bytes of tensor w into L2 (returns at once; the lines arrive later).
spin(cycles): one thread busy for `cycles` SM clocks (the benchmark's stand-in for other work).
The cubin comes from the artifact, the kdtree cache or NVRTC/nvcc (plugins/common/cubin.py).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from plugins.common.cubin import load_module
from plugins.common.device import device_facts
from plugins.common.driver import checked

SOURCE = Path(__file__).with_name("l2_prefetch.cu")
CHUNK = 64 << 10  # bytes per bulk prefetch request
THREADS = 128

_FUNCS: dict[int, dict[str, object]] = {}


def _func(device: torch.device, name: str):
    from cuda.bindings import driver as cu
    index = device.index if device.index is not None else torch.cuda.current_device()
    funcs = _FUNCS.get(index)
    if funcs is None:
        module, _ = load_module(SOURCE, torch.device("cuda", index), "l2_prefetch")
        funcs = _FUNCS[index] = {n: checked(cu, cu.cuModuleGetFunction(module, n.encode()), f"l2_prefetch: {n}")
                                 for n in ("kdtree_l2_prefetch", "kdtree_spin")}
    return cu, funcs[name]


def _launch(device: torch.device, name: str, grid: int, threads: int, args: tuple, types: tuple) -> None:
    cu, func = _func(device, name)
    stream = cu.CUstream(torch.cuda.current_stream(device).cuda_stream)
    checked(cu, cu.cuLaunchKernel(func, grid, 1, 1, threads, 1, 1, 0, stream, (args, types), 0),
            f"l2_prefetch: launch {name}")


def prefetch_l2(w: torch.Tensor, chunk: int = CHUNK, evict_last: bool = False) -> None:
    """Bulk-prefetch the storage of the contiguous CUDA tensor w into L2 (a hint; no result depends on it);
    evict_last: with L2's evict-last policy (kept over lines streamed in after them)."""
    if not w.is_cuda or not w.is_contiguous():
        raise ValueError(f"prefetch_l2: a contiguous CUDA tensor, got {w.device} contiguous={w.is_contiguous()}")
    nbytes = w.numel() * w.element_size()
    if nbytes == 0:
        return
    if nbytes % 16 or w.data_ptr() % 16 or chunk % 16:
        raise ValueError(f"prefetch_l2: bytes ({nbytes}), address and chunk ({chunk}) must be multiples of 16")
    requests = -(-nbytes // chunk)
    grid = min(-(-requests // THREADS), device_facts(w.device).sms)
    _launch(w.device, "kdtree_l2_prefetch", grid, THREADS, (w.data_ptr(), nbytes, chunk, int(evict_last)),
            (ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_uint, ctypes.c_int))


def spin(cycles: int, device: torch.device) -> None:
    """One thread of one CTA busy for `cycles` SM clocks on the current stream."""
    _launch(device, "kdtree_spin", 1, 1, (cycles,), (ctypes.c_longlong,))
