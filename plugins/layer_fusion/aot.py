"""Ahead-of-time specialisations of layer_fusion kernels for `kdtree build` (build_pipeline/compile_kernels.py).

Listed: the attention's split combine folded into the W_UV absorption (combine_absorb.py, the runtime's
FUSED_COMBINE) at K2.6's shapes, bf16, c 512 = tree_verify_mla's d_v, u 128, with PDL on (the default on sm_90+):
one kernel per power-of-two split padding the attention's plan can produce (S_PAD 2 .. MAX_SPLITS), its tiles as
its launcher picks them (fold_blocks: tok is an argument, block_u and block_k follow from u and S_PAD).  Pointers,
u and the W_UV / output strides are declared 16-divisible (true at those shapes); the counts are not specialised.
The other layer_fusion kernels are not listed here (tests/test_kernels_compile_sm90.py compiles them).
"""

from __future__ import annotations

from plugins.common.aot import TritonKernel
from plugins.layer_fusion.combine_absorb import ROWS, _mla_combine_v_absorb_kernel, fold_blocks

C, U = 512, 128  # K2.6's kv_lora_rank (tree_verify_mla's d_v) and v_head_dim
# tree_verify_mla's launcher.MAX_SPLITS (ops import no other op: tests/test_mla_combine_absorb.py keeps them equal)
MAX_SPLITS = 512


def _fold_kernel(s_pad: int) -> TritonKernel:
    _, block_u, block_k = fold_blocks(1, s_pad, U, C, 2)
    ints = ("T", "N", "H", "U", "num_splits", "tok", "s_wh", "s_wu", "s_yt", "s_yh")
    sig = {"opart_ptr": "*fp32", "lpart_ptr": "*fp32", "w_ptr": "*bf16", "out_ptr": "*bf16", **{k: "i32" for k in ints}}
    consts = {"C": C, "S_PAD": s_pad, "IEEE": False, "BT": ROWS, "BLOCK_U": block_u, "BLOCK_K": block_k, "PDL": True}
    sig.update({k: "constexpr" for k in consts})
    names = list(sig)
    aligned = ("opart_ptr", "lpart_ptr", "w_ptr", "out_ptr", "U", "s_wh", "s_wu", "s_yt", "s_yh")
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in aligned}
    return TritonKernel(op="layer_fusion", name=f"combine_v_absorb_s{s_pad}_bf16", fn=_mla_combine_v_absorb_kernel,
                        signature=sig, constexprs=consts, num_warps=4, num_stages=3, attrs=attrs)


def aot_kernels(budgets: tuple[int, ...]) -> list[TritonKernel]:
    """The fold at every S_PAD (budgets: unused, the kernel takes any token count)."""
    del budgets
    return [_fold_kernel(1 << k) for k in range(1, MAX_SPLITS.bit_length())]
