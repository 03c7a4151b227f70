"""AOT specialisations of the tree_accept and posterior kernels for `kdtree build`
(build_pipeline/compile_kernels.py): one tree_accept kernel per tree budget B (N = B + 1 nodes),
and the posterior kernel for bf16 and fp32 logits, argmax and sampling.  The launch parameters
(BLOCK, num_warps) are the ones the JIT launchers in kernel.py and posterior.py pick."""

from __future__ import annotations

import triton

from plugins.common.aot import TritonKernel
from plugins.tree_accept.kernel import _tree_accept_kernel, _warps
from plugins.tree_accept.posterior_kernel import posterior_kernel

POSTERIOR_BLOCK_V, POSTERIOR_WARPS = 4096, 8  # posterior_triton's defaults


def aot_kernels(budgets: tuple[int, ...]) -> list[TritonKernel]:
    sig = {"post_ptr": "*i64", "tok_ptr": "*i64", "par_ptr": "*i32", "idx_ptr": "*i32", "len_ptr": "*i32",
           "bonus_ptr": "*i64", "n": "i32", "a": "i32", "s_post": "i32", "s_tok": "i32", "s_par": "i32",
           "s_idx": "i32", "BLOCK": "constexpr", "PDL": "constexpr"}  # PDL: as sm_90+ launches them
    out = []
    for b in dict.fromkeys(budgets):
        block = max(triton.next_power_of_2(b + 1), 16)  # as tree_accept_triton for N = b + 1
        out.append(TritonKernel("tree_accept", f"tree_accept_b{b}", _tree_accept_kernel, sig,
                                {"BLOCK": block, "PDL": True},
                                num_warps=_warps(block)))
    for dtype in ("bf16", "fp32"):
        sig = {"logits_ptr": f"*{dtype}", "out_ptr": "*i64", "state_ptr": "*i64", "inv_temp_ptr": "*fp32",
               "flag_ptr": "*i64", "v": "i32", "s_row": "i64", "rows_per_req": "i64", "SAMPLE": "constexpr",
               "FLAG": "constexpr", "BLOCK_V": "constexpr", "PDL": "constexpr"}
        for sample in (False, True):  # the round always asks for the non-finite flag
            out.append(TritonKernel("posterior", f"posterior_{dtype}_{'sample' if sample else 'argmax'}",
                                    posterior_kernel, sig, {"SAMPLE": sample, "FLAG": True,
                                                            "BLOCK_V": POSTERIOR_BLOCK_V, "PDL": True},
                                    num_warps=POSTERIOR_WARPS))
    return out
