"""plugins/common/tensor_maps: the arguments each TMA descriptor is encoded with, through a driver stand-in that
records calls (CPU; the GPU tests of skinny_wgmma and tree_verify_wgmma run the kernels on the real maps)."""

from __future__ import annotations

import types

import pytest
import torch

from plugins.common import tensor_maps
from plugins.skinny_gemm import wgmma_launch as skinny_wgmma
from plugins.tree_verify_mla import wgmma_launch as tree_wgmma

ENUMS = ("CU_TENSOR_MAP_DATA_TYPE_BFLOAT16", "CU_TENSOR_MAP_INTERLEAVE_NONE", "CU_TENSOR_MAP_SWIZZLE_128B",
         "CU_TENSOR_MAP_L2_PROMOTION_L2_256B", "CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE", "CUDA_SUCCESS")


class FakeDriver:
    """cuda.bindings.driver as far as the encoder uses it: integers tagged with their type, enums by name."""

    def __init__(self, fail: bool = False):
        self.calls, self.fail = [], fail
        names = {k: k for k in ENUMS}
        for enum in ("CUtensorMapDataType", "CUtensorMapInterleave", "CUtensorMapSwizzle", "CUtensorMapL2promotion",
                     "CUtensorMapFloatOOBfill", "CUresult"):
            setattr(self, enum, types.SimpleNamespace(**names))
        self.cuuint64_t = lambda v: ("u64", int(v))
        self.cuuint32_t = lambda v: ("u32", int(v))

    def cuTensorMapEncodeTiled(self, *args):
        self.calls.append(args)
        return ("CUDA_ERROR_INVALID_VALUE" if self.fail else "CUDA_SUCCESS", object())


@pytest.fixture(autouse=True)
def _empty_cache():
    tensor_maps._MAPS.clear()
    yield
    tensor_maps._MAPS.clear()


def _u64(*v):
    return [("u64", x) for x in v]


def _u32(*v):
    return [("u32", x) for x in v]


def test_skinny_wgmma_map_of_a_strided_matrix():
    x = torch.empty(40, 7296, dtype=torch.bfloat16)[:, :7168]  # rows 14592 bytes apart
    cu = FakeDriver()
    skinny_wgmma.tensor_map(cu, x, 24)
    (args,) = cu.calls
    assert args[0] == "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16" and args[1] == 2 and args[2] == x.data_ptr()
    assert args[3:7] == (_u64(7168, 40), _u64(14592), _u32(64, 24), _u32(1, 1))
    assert args[7:] == ("CU_TENSOR_MAP_INTERLEAVE_NONE", "CU_TENSOR_MAP_SWIZZLE_128B",
                        "CU_TENSOR_MAP_L2_PROMOTION_L2_256B", "CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE")
    skinny_wgmma.tensor_map(cu, x, 24)
    assert len(cu.calls) == 1  # encoded once a buffer and shape
    skinny_wgmma.tensor_map(cu, x[:9], 16)
    assert len(cu.calls) == 2 and cu.calls[1][3:6] == (_u64(7168, 9), _u64(14592), _u32(64, 16))


def test_tree_verify_wgmma_map_of_a_cache_and_an_empty_one():
    cache = torch.empty(2, 5000, 576, dtype=torch.bfloat16)
    cu = FakeDriver()
    tree_wgmma.tensor_map(cu, cache)
    assert cu.calls[0][1] == 3
    assert cu.calls[0][3:7] == (_u64(576, 5000, 2), _u64(1152, 5000 * 1152), _u32(64, 64, 1), _u32(1, 1, 1))
    empty = torch.empty(2, 0, 576, dtype=torch.bfloat16)
    tree_wgmma.tensor_map(cu, empty)
    assert cu.calls[1][3] == _u64(576, 1, 2)  # no rows: one row's box, read as zeros


def test_oldest_map_goes_first_and_bad_requests_are_named(monkeypatch):
    monkeypatch.setattr(tensor_maps, "MAX_MAPS", 2)
    cu = FakeDriver()
    w = torch.empty(8, 64, dtype=torch.bfloat16)
    for rows in (1, 2, 3):
        skinny_wgmma.tensor_map(cu, w[:rows], 8)
    assert len(tensor_maps._MAPS) == 2 and len(cu.calls) == 3
    skinny_wgmma.tensor_map(cu, w[:1], 8)  # evicted: encoded again
    assert len(cu.calls) == 4
    with pytest.raises(RuntimeError, match="skinny_wgmma: cuTensorMapEncodeTiled"):
        skinny_wgmma.tensor_map(FakeDriver(fail=True), w[:5], 8)
    with pytest.raises(ValueError, match="bf16 tensor map"):
        tensor_maps.bf16_tensor_map(cu, w.float(), (64, 8), (256,), (64, 8), "test")
    with pytest.raises(ValueError, match="bf16 tensor map"):
        tensor_maps.bf16_tensor_map(cu, w, (64, 8), (128,), (32, 8), "test")
