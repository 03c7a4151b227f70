"""AOT specialisations of the kv_commit kernels for `kdtree build` (build_pipeline/compile_kernels.py):
the copy kernel for the bf16 latent cache (d_qk = 576 = 512 + 64) with and without drafter features,
and the cache_lens advance.  Tile sizes and warps are kv_commit_triton's defaults; strides that can
pass 2^31 elements (layer and request strides of a 262144-row cache) are i64.  Independent of budgets."""

from __future__ import annotations

from plugins.common.aot import TritonKernel
from plugins.kv_commit.kernel import ADVANCE_BLOCK, _advance_lens_kernel, _kv_commit_copy_kernel

D_QK = 576
LAYERS_PER_PROGRAM, FEATS_PER_PROGRAM, NUM_WARPS = 8, 4096, 4  # kv_commit_triton's defaults


def aot_kernels(budgets: tuple[int, ...]) -> list[TritonKernel]:
    del budgets  # the copy grid depends on b and a at launch time only
    sig = {"cache_ptr": "*bf16", "lens_ptr": "*i32", "scratch_ptr": "*bf16", "idx_ptr": "*i32", "alen_ptr": "*i32",
           "feats_ptr": "*bf16", "ctx_ptr": "*bf16", "y": "i32", "l_max": "i32", "n": "i32", "n_feat": "i32",
           "f": "i32", "a": "i32", "n_layer_chunks": "i32", "n_feat_chunks": "i32",
           "s_cy": "i64", "s_cb": "i64", "s_cl": "i64", "s_sy": "i64", "s_sb": "i64", "s_sn": "i64", "s_ib": "i32",
           "s_fb": "i64", "s_fn": "i64", "s_xb": "i64", "s_xa": "i64",
           "D": "constexpr", "D_MAIN": "constexpr", "D_REST": "constexpr", "LCH": "constexpr", "FB": "constexpr",
           "HAS_FEATS": "constexpr", "PDL": "constexpr"}
    d_main = 1 << (D_QK.bit_length() - 1)
    tile = {"D": D_QK, "D_MAIN": d_main, "D_REST": D_QK - d_main, "LCH": LAYERS_PER_PROGRAM, "FB": FEATS_PER_PROGRAM,
            "PDL": True}  # sm_90+ launches them with programmatic dependent launch (plugins/common/pdl.py)
    out = [TritonKernel("kv_commit", f"kv_commit_copy_d{D_QK}_{'feats' if feats else 'nofeats'}",
                        _kv_commit_copy_kernel, sig, {**tile, "HAS_FEATS": feats}, num_warps=NUM_WARPS)
           for feats in (True, False)]
    out.append(TritonKernel("kv_commit", "kv_commit_advance", _advance_lens_kernel,
                            {"lens_ptr": "*i32", "alen_ptr": "*i32", "b": "i32", "BLOCK": "constexpr",
                             "PDL": "constexpr"}, {"BLOCK": ADVANCE_BLOCK, "PDL": True}, num_warps=1))
    return out
