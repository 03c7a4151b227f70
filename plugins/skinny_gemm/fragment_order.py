"""A dense weight in skinny_gemm.cu's fragment order: what each lane of a warp loads for one 32-column block, stored
lane after lane, so that a warp's load of a block is 512 contiguous bytes (twice: rows g and rows g + 8) instead of
sixteen 64-byte pieces of sixteen rows.

w [n, k] (row-major) -> wf [groups, k / 32, 2, 32, 8] with groups = ceil(n / 16), rows past n zero:
    wf[rg, kb, half, 4 g + q, :] = w[16 rg + 8 half + g, 32 kb + 8 q : 32 kb + 8 q + 8]
which is exactly the 16 bytes lane (g, q) of the row-major kernel loads from rows g (half 0) and g + 8 (half 1) of
row group rg at block kb.  A row group's blocks follow each other, so a CTA's weights are one contiguous range.

benchmarks/boundary_cost.py timed the row-major pattern's cost against contiguous warp reads at the same bytes
(H200: qkv_a 8.13 against 6.66 µs, o_proj 4.03 against 3.36): the `_frag` kernels read this layout with the same
loads and math, so they give the same bits (tests/test_skinny_gemm.py).

fragment_copy(w): the copy the runtime's one-token GEMMs read with runtime.model.layers.FRAG_WEIGHTS on (off until
measured: benchmarks/k26_switches.py's skinny_frag), made at a weight's first such GEMM outside a CUDA graph capture
(the warm-up calls before a capture) and kept while the weight lives.
"""

from __future__ import annotations

import weakref

import torch

ROWS = 16  # a row group
BLOCK_K = 32  # columns a block
LANE_COLS = 8  # bf16 columns a lane loads per row (16 bytes)


def to_fragment_order(w: torch.Tensor) -> torch.Tensor:
    """w [n, k] with k % 32 == 0 -> wf [ceil(n / 16), k / 32, 2, 32, 8] (same dtype and device; rows past n zero)."""
    if w.dim() != 2 or w.shape[1] % BLOCK_K:
        raise ValueError(f"to_fragment_order: w must be [n, k] with k % {BLOCK_K} == 0, got {list(w.shape)}")
    n, k = w.shape
    groups = -(-n // ROWS)
    padded = w.new_zeros(groups * ROWS, k)
    padded[:n] = w
    # [rg, half, g, kb, q, c] -> [rg, kb, half, g, q, c]: lane 4 g + q
    v = padded.view(groups, 2, ROWS // 2, k // BLOCK_K, BLOCK_K // LANE_COLS, LANE_COLS)
    return v.permute(0, 3, 1, 2, 4, 5).contiguous().view(groups, k // BLOCK_K, 2, 32, LANE_COLS)


def from_fragment_order(wf: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of to_fragment_order: wf [groups, k / 32, 2, 32, 8] -> w [n, k]."""
    if wf.dim() != 5 or tuple(wf.shape[2:]) != (2, 32, LANE_COLS) or not 0 < n <= wf.shape[0] * ROWS:
        raise ValueError(f"from_fragment_order: wf must be [groups, k/32, 2, 32, 8] holding {n} rows, got "
                         f"{list(wf.shape)}")
    groups, blocks = wf.shape[:2]
    v = wf.view(groups, blocks, 2, ROWS // 2, BLOCK_K // LANE_COLS, LANE_COLS)
    return v.permute(0, 2, 3, 1, 4, 5).reshape(groups * ROWS, blocks * BLOCK_K)[:n]


_COPIES: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}  # id(w) -> (w, its version, its fragment-order copy)


def fragment_copy(w: torch.Tensor) -> torch.Tensor | None:
    """The fragment-order copy of weight w (to_fragment_order), made at the first ask and kept while w lives (and is
    not written: a changed version makes it again); None inside a CUDA graph capture before it exists (nothing is
    allocated in a capture's pool: the caller then reads w row-major)."""
    key = id(w)
    hit = _COPIES.get(key)
    if hit is not None and hit[0]() is w and hit[1] == w._version:
        return hit[2]
    if w.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    _COPIES[key] = (weakref.ref(w, lambda _ref, key=key: _COPIES.pop(key, None)), w._version, to_fragment_order(w))
    return _COPIES[key][2]
