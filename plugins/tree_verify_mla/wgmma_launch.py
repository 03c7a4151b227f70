"""Launch of tree_verify_wgmma.cu (the split kernel of 64 query rows a CTA on Hopper's warpgroup MMA) through the driver
API on torch's current stream: capturable in a CUDA graph, PDL on sm_90.  The cubin comes from the artifact, the
kdtree cache or NVRTC/nvcc, compiled for sm_90a (plugins/common/cubin.py).  launcher.py decides where it runs (its
plan, the workspace and the combine are the Triton path's); this file loads and launches it.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from core.env_flags import env_flag
from plugins.common.cubin import load_module
from plugins.common.device import device_facts
from plugins.common.device_modules import NotForThisDevice, PerDevice
from plugins.common.driver import Functions, launch
from plugins.common.tensor_maps import bf16_tensor_map

SOURCE = Path(__file__).with_name("tree_verify_wgmma.cu")
KERNEL = "tree_verify_wgmma"
THREADS = 256  # two warpgroups
BLOCK_M = BLOCK_N = 64  # query rows a CTA, keys a tile (the .cu's BM, BN)
D_QK, D_V = 576, 512  # the widths the .cu is written for (K2.6's latent row)
SMEM = 229904 + 1024  # the .cu's SMEM_BYTES and the slack to align it to 1024 bytes
# KDTREE_ATTN_WGMMA_EARLY (on; =0 turns it off; k26_switches attn_early): a split whose first key tile is a committed
# one issues its TMA before the PDL wait (the .cu's `early`), under the predecessor grid; the same bits.  H200, K2.6
# rank at 40 layers, 4K: DDTree-16 -0.7 % (results/k26-switches.json)
EARLY = env_flag("KDTREE_ATTN_WGMMA_EARLY", True)
# KDTREE_ATTN_WGMMA_EARLY2 (on; =0 turns it off; k26_switches attn_early2): with EARLY, the second stage's tile too
# when it is a committed one (a DDTree-16 round's splits at 4K take 3 tiles).  H100, K2.6 rank at 40 layers, 4K:
# DDTree-16 step -0.5 %, AR level (results/k26-switches-h100.json calls 19-20)
EARLY2 = env_flag("KDTREE_ATTN_WGMMA_EARLY2", True)


class WgmmaAttentionWarning(UserWarning):
    """The wgmma kernel could not be loaded; the Triton split kernel runs instead."""


def _load(dev: torch.device) -> tuple[object, object]:
    """(cuda.bindings.driver, the kernel's CUfunction with its shared memory limit set) on dev."""
    arch = device_facts(dev).arch
    if arch != "sm_90":
        raise NotForThisDevice(f"{arch} has no wgmma (sm_90a)")
    from cuda.bindings import driver as cu
    torch.empty(1, device=dev)  # the device's primary context, current before the driver loads the module
    module, _ = load_module(SOURCE, dev, "tree_verify_wgmma")
    return cu, Functions(cu, module, "tree_verify_wgmma").get(KERNEL, SMEM)


_FUNCS: PerDevice[tuple[object, object]] = PerDevice("tree_verify_wgmma", WgmmaAttentionWarning,
                                                       "the Triton split kernel runs")


def available(device: torch.device) -> bool:
    """Whether the kernel loads on `device` (an sm_90 GPU; loading it at the first ask); one warning naming why when it
    does not.  Asked first inside a CUDA graph capture, False without loading (the warm-up calls come first)."""
    return _FUNCS.get(device, _load) is not None


def takes(dtype: torch.dtype, d_qk: int, d_v: int) -> bool:
    """Whether the kernel is written for these: bf16 rows of D_QK with D_V value columns."""
    return dtype == torch.bfloat16 and (d_qk, d_v) == (D_QK, D_V)


def aligned(q: torch.Tensor, cache: torch.Tensor, tree_kv: torch.Tensor) -> bool:
    """q's rows move by cp.async, cache's and tree_kv's by TMA, 16 bytes at a time: the rows and bases must be 16-byte
    aligned."""
    return all(t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])
               for t in (q, cache, tree_kv))


def tensor_map(cu, t: torch.Tensor) -> object:
    """The CUtensorMap of a [b, rows, 576] bf16 tensor as the .cu reads it: boxes of 64 columns x BLOCK_N rows x 1
    request, 128-byte swizzle, rows past `rows` read as zeros (plugins/common/tensor_maps)."""
    b, rows, width = t.shape
    size = t.element_size()
    return bf16_tensor_map(cu, t, (width, max(rows, 1), b), (t.stride(1) * size, t.stride(0) * size), (64, BLOCK_N, 1),
                           KERNEL)


def launch_split(q: torch.Tensor, cache: torch.Tensor, cache_lens: torch.Tensor, tree_kv: torch.Tensor,
                 tree_mask: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, o_part: torch.Tensor,
                 l_part: torch.Tensor, num_splits: int, scale2: float, pdl: bool) -> None:
    """The split kernel over grid (cdiv(n h, 64), num_splits b): out / lse directly with one split, else the partials
    o_part [b, s, n h, 512] / l_part [b, s, n h] (base 2) for launcher.py's combine.  Inputs as launcher checks them,
    bf16 with d_qk 576, d_v 512, aligned(); available(q.device) was asked first.  The key tiles come through tensor
    maps of cache and tree_kv (a cache of 0 rows takes the tree's map: no committed tile is read then)."""
    b, n, h, _ = q.shape
    cu, func = _FUNCS[q.device]
    tree_map = tensor_map(cu, tree_kv)
    cache_map = tensor_map(cu, cache) if cache.shape[1] else tree_map
    ptr, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float
    args = (cache_map, tree_map, q.data_ptr(), cache_lens.data_ptr(), tree_mask.data_ptr(), out.data_ptr(),
            lse.data_ptr(), o_part.data_ptr(), l_part.data_ptr(),
            q.stride(0), q.stride(1), q.stride(2), tree_mask.stride(0), tree_mask.stride(1), out.stride(0),
            out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), n, h, cache.shape[1], num_splits, scale2,
            int(num_splits == 1), int(out.dtype == torch.float32), (2 if EARLY2 else 1) if EARLY and pdl else 0)
    types = (None, None) + (ptr,) * 7 + (i64,) * 10 + (i32, i32, i32, i32, f32, i32, i32, i32)  # None: a cuda object
    stream = cu.CUstream(torch.cuda.current_stream(q.device).cuda_stream)
    grid = ((n * h + BLOCK_M - 1) // BLOCK_M, num_splits * b)
    launch(cu, func, grid, THREADS, SMEM, stream, args, types, pdl, f"{KERNEL}: launch", q.device.index)
