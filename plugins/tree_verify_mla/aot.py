"""Ahead-of-time specialisations of the tree_verify_mla kernels for `kdtree build`
(build_pipeline/compile_kernels.py): bf16, d_qk 576 = d_v 512 + d_r 64 (Kimi / DeepSeek-V3 MLA).

One split kernel per config of launcher.CONFIGS_16BIT and LONG_TILE_CONFIG (an AR step over a long cache), in
both forms (DIRECT: one split writes out/lse; parts: partials for the combine), with PDL on (the launcher's default
on sm_90+), and one combine kernel per power-of-two split padding the plan can produce (S_PAD 2 .. MAX_SPLITS).
Argument order and types are the launcher's (launcher.tree_verify_mla_triton); pointers and the row
strides of q, cache, tree_kv and out are declared 16-divisible (true for d_qk 576 / d_v 512 rows),
the mask and lse strides and the shape scalars are not specialised.
"""

from __future__ import annotations

from plugins.common.aot import TritonKernel
from plugins.tree_verify_mla.kernel import tree_verify_mla_combine_kernel, tree_verify_mla_split_kernel
from plugins.tree_verify_mla.launcher import CONFIGS_16BIT, LONG_TILE_CONFIG, MAX_SPLITS

D_V, D_R = 512, 64
_SPLIT_PTRS = ("q_ptr", "cache_ptr", "lens_ptr", "tree_ptr", "mask_ptr", "out_ptr", "lse_ptr", "opart_ptr",
               "lpart_ptr")
_SPLIT_INTS = ("stride_qb", "stride_qn", "stride_qh", "stride_cb", "stride_cl", "stride_tb", "stride_tn",
               "stride_mb", "stride_mn", "stride_ob", "stride_on", "stride_oh", "stride_lb", "stride_ln",
               "n", "h", "l_max", "num_splits")
_ALIGNED = {"stride_qb", "stride_qn", "stride_qh", "stride_cb", "stride_cl", "stride_tb", "stride_tn",
            "stride_ob", "stride_on", "stride_oh"}


def _split_kernel(cfg, direct: bool) -> TritonKernel:
    types = {"q_ptr": "*bf16", "cache_ptr": "*bf16", "lens_ptr": "*i32", "tree_ptr": "*bf16", "mask_ptr": "*i64",
             "out_ptr": "*bf16", "lse_ptr": "*fp32", "opart_ptr": "*fp32", "lpart_ptr": "*fp32"}
    sig = {**types, **{k: "i32" for k in _SPLIT_INTS}, "scale2": "fp32"}
    consts = {"D_V": D_V, "D_R": D_R, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "DV_SPLIT": cfg.dv_split,
              "KEYS_M": cfg.keys_m, "DIRECT": direct, "IEEE": False, "PDL": True, "PREFETCH": False}
    sig.update({k: "constexpr" for k in consts})
    names = list(sig)
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in (*_SPLIT_PTRS, *_ALIGNED)}
    return TritonKernel(op="tree_verify_mla", name=f"split_{cfg.tag()}_{'direct' if direct else 'parts'}_bf16",
                        fn=tree_verify_mla_split_kernel, signature=sig, constexprs=consts,
                        num_warps=cfg.num_warps, num_stages=cfg.num_stages, attrs=attrs)


def _combine_kernel(s_pad: int) -> TritonKernel:
    block_dv = min(D_V, max(16, 8192 // s_pad))  # as the launcher
    sig = {"opart_ptr": "*fp32", "lpart_ptr": "*fp32", "out_ptr": "*bf16", "lse_ptr": "*fp32",
           **{k: "i32" for k in ("stride_ob", "stride_on", "stride_oh", "stride_lb", "stride_ln", "n", "h",
                                 "num_splits")}}
    consts = {"S_PAD": s_pad, "D_V": D_V, "BLOCK_DV": block_dv, "PDL": True}
    sig.update({k: "constexpr" for k in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(7)}  # 4 pointers, out strides
    return TritonKernel(op="tree_verify_mla", name=f"combine_s{s_pad}_bf16", fn=tree_verify_mla_combine_kernel,
                        signature=sig, constexprs=consts, num_warps=4, num_stages=1, attrs=attrs)


def aot_kernels(budgets: tuple[int, ...]) -> list[TritonKernel]:
    """Every specialisation the launcher uses for bf16 at d_qk 576 / d_v 512 (budgets: unused, the
    kernels take any tree size)."""
    del budgets
    configs = list(dict.fromkeys([*(cfg for _, cfg in CONFIGS_16BIT), LONG_TILE_CONFIG]))
    kernels = [_split_kernel(cfg, direct) for cfg in configs for direct in (False, True)]
    s_pad = 2
    while s_pad <= MAX_SPLITS:
        kernels.append(_combine_kernel(s_pad))
        s_pad *= 2
    return kernels
