"""A tiny Triton kernel declared for AOT compilation (tests/test_build.py): the `plugins/<op>/aot.py`
convention of build_pipeline/compile_kernels.py, exercised without depending on a real plugin."""

import triton
import triton.language as tl

from plugins.common.aot import TritonKernel


@triton.jit
def _add_one(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=keep) + 1.0, mask=keep)


def aot_kernels(budgets):
    return [TritonKernel(op="demo", name=f"add_one_b{b}", fn=_add_one,
                         signature={"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                         constexprs={"BLOCK": b}, num_warps=1) for b in budgets]
