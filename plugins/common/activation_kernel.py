"""SiLU * up as the fused kernels compute it (layer_fusion's silu_mul, moe_w4a16's routing kernel for the shared
expert): one Triton function, so every kernel that forms it rounds as plugins/common/activation.py (the torch
reference) does.

silu_mul_rounded(g, u, DT, IEEE_EXP): g, u any float -> silu(g) * u in DT, with the reference's roundings: g and
u rounded to DT first (a wider GEMM output stands for the DT output it replaces), silu(g) rounded to DT, the
product rounded to DT.  exp and division are the IEEE ones torch uses (libdevice's expf on the GPU; the
interpreter, which has no libdevice, takes tl.exp).  No a * b + c appears, so fp contraction cannot change it.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def silu_mul_rounded(g, u, DT: tl.constexpr, IEEE_EXP: tl.constexpr):
    g = g.to(DT).to(tl.float32)
    u = u.to(DT).to(tl.float32)
    if IEEE_EXP:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    act = tl.math.div_rn(g, 1.0 + e).to(DT).to(tl.float32)
    return (act * u).to(DT)
