"""Order-preserving integer keys for fp32 scores: one int64 max-reduction picks (score desc, tie asc)
(tree_build's top-k and tree kernels, moe_w4a16's routing).

ordered(x): fp32 -> int32 whose signed order is the float order (-0.0 made +0.0 first), so a packed
int64 key (ordered(score) << 31) | (0x7FFFFFFF - tie) sorted descending is score descending, then
tie ascending (tie < 2^31).  unordered() inverts ordered().
"""

from __future__ import annotations

import triton
import triton.language as tl

LOW_MASK = 0x7FFFFFFF  # the low 31 bits of a packed key hold 0x7FFFFFFF - tie


@triton.jit
def ordered(x):
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def unordered(k):
    bits = tl.where(k < 0, k ^ 0x7FFFFFFF, k)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def pack(score, tie):
    """fp32 score, int tie (0 <= tie < 2^31) -> int64 key: descending = (score desc, tie asc)."""
    return (ordered(score).to(tl.int64) << 31) | (0x7FFFFFFF - tie.to(tl.int64))


@triton.jit
def unpack(key):
    """int64 key -> (ordered score int32, tie int32)."""
    return (key >> 31).to(tl.int32), (0x7FFFFFFF - (key & 0x7FFFFFFF)).to(tl.int32)


@triton.jit
def max_combine(a, b):
    return tl.maximum(a, b)
