"""The skinny GEMM in Triton: y [t, n] = x [t, k] . W [n, k]^T (+ c [t, n]), fp32 accumulation, one rounding.

Why: at t = 1..65 tokens these projections are reads of W (2 bytes per weight, ~1 flop per byte), and
cuBLAS spends ~2.8 ms of a 6.4 ms K2.6 TP8 decode step on them (~1.0 ms of bytes), partly in a split-K
second kernel (splitKreduce) per GEMM.  Here one program owns BLOCK_N rows of W and BLOCK_M tokens and
streams its rows over the whole k: one kernel, no partial sums in memory, and each output element's sum
runs over k in one fixed order (slices of BLOCK_K in order, the tensor-core order within a slice), so a
row's result does not depend on t or on which program is scheduled first, for one config.

Layout: W's [BLOCK_N, BLOCK_K] slice is the dot's first operand (the long side: Hopper's wgmma takes
M >= 64 there), x's [BLOCK_M, BLOCK_K] slice transposed the second; the accumulator is [BLOCK_N, BLOCK_M]
and is stored transposed into y's rows.  Grid axis 0 is the token block, so the programs that read the
same weight rows are launched next to each other (the second reads them from L2).  W is loaded
evict_first (read once), x evict_last (every row block reads it again).  K is a compile-time constant
(a model has four: 7168, 1536, 1024, 256): the trip count is known to the pipeliner, and Triton's
interpreter cannot loop over a run-time scalar argument (NumPy 2 refuses int() of its 1-element array).
fp32 inputs use the IEEE dot (no TF32), so fp32 matches the reference to summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plugins.dense_gemm.config import GemmConfig


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, c_ptr, y_ptr, T, N, s_x, s_c, s_y, K: tl.constexpr, HAS_C: tl.constexpr,
                   IEEE: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    toks = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] token rows of x and y
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] weight rows = output columns
    tok_ok, row_ok = toks < T, rows < N
    kk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * K + kk[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + toks.to(tl.int64)[:, None] * s_x + kk[None, :]  # [BLOCK_M, BLOCK_K]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=row_ok[:, None], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=tok_ok[:, None], other=0.0, eviction_policy="evict_last")
        else:
            k_ok = k0 + kk < K
            w = tl.load(w_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=tok_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_last")
        if IEEE:
            acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(x), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    mask = row_ok[:, None] & tok_ok[None, :]  # [BLOCK_N, BLOCK_M]
    if HAS_C:
        acc += tl.load(c_ptr + toks.to(tl.int64)[None, :] * s_c + rows[:, None], mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + toks.to(tl.int64)[None, :] * s_y + rows[:, None], acc.to(y_ptr.dtype.element_ty), mask=mask)


def skinny_linear_triton(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor | None, y: torch.Tensor,
                         cfg: GemmConfig) -> None:
    """y [t, n] = x [t, k] . w [n, k]^T (+ c [t, n]); unit stride along k / n, w contiguous (the caller checks)."""
    t, k = x.shape
    n = w.shape[0]
    if t == 0 or n == 0:
        return
    grid = (triton.cdiv(t, cfg.block_m), triton.cdiv(n, cfg.block_n))
    cc = c if c is not None else y
    _skinny_kernel[grid](x, w, cc, y, t, n, x.stride(0), cc.stride(0), y.stride(0), K=k, HAS_C=c is not None,
                         IEEE=x.dtype == torch.float32, EVEN_K=k % cfg.block_k == 0, BLOCK_M=cfg.block_m,
                         BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_stages=cfg.stages, num_warps=cfg.warps)
