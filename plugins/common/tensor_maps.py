"""TMA descriptors (CUtensorMap) of bf16 tensors in the one layout our wgmma kernels read: 64-column (128-byte) boxes
with the 128-byte swizzle, L2 promotion of 256 bytes, and zeros past the ends; encoded once per buffer and shape.

skinny_gemm/skinny_wgmma.cu (weights and tokens, 2-D) and tree_verify_mla/tree_verify_wgmma.cu (the latent cache and
the tree's rows, 3-D) take them as __grid_constant__ kernel arguments.
"""

from __future__ import annotations

import torch

from plugins.common.driver import checked

BOX_COLS = 64  # bf16 columns a box: 128 bytes, the swizzle's span
MAX_MAPS = 768  # maps kept (the runtime's buffers are fixed, so the same keys recur; the oldest goes first)
_MAPS: dict[tuple, object] = {}  # (device index, address, dims, byte strides, box) -> CUtensorMap


def bf16_tensor_map(cu, t: torch.Tensor, dims: tuple[int, ...], byte_strides: tuple[int, ...],
                    box: tuple[int, ...], what: str) -> object:
    """The CUtensorMap of bf16 tensor t viewed as `dims` (innermost first; the innermost has unit stride), the outer
    dims `byte_strides` apart, read in boxes of `box` elements (box[0] = BOX_COLS); cu: cuda.bindings.driver.  A
    failed encode raises RuntimeError naming `what`."""
    if t.dtype != torch.bfloat16 or len(box) != len(dims) or len(byte_strides) != len(dims) - 1 \
            or box[0] != BOX_COLS:
        raise ValueError(f"{what}: a bf16 tensor map needs a box per dim (the first {BOX_COLS} wide) and a stride per "
                         f"outer dim, got {t.dtype}, dims {dims}, strides {byte_strides}, box {box}")
    key = (t.device.index, t.data_ptr(), dims, byte_strides, box)
    found = _MAPS.get(key)
    if found is not None:
        return found
    u64, u32 = cu.cuuint64_t, cu.cuuint32_t
    found = checked(cu, cu.cuTensorMapEncodeTiled(
        cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, len(dims), t.data_ptr(),
        [u64(d) for d in dims], [u64(s) for s in byte_strides], [u32(b) for b in box], [u32(1)] * len(dims),
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
        f"{what}: cuTensorMapEncodeTiled {tuple(t.shape)}")
    if len(_MAPS) >= MAX_MAPS:
        _MAPS.pop(next(iter(_MAPS)))
    _MAPS[key] = found
    return found
