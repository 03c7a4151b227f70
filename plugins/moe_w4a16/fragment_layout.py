"""The v3 kernel's layout of INT4 experts ("fragment order"), and the exact conversions to and from the
checkpoint form.

The v3 kernels (moe_v3.cu) multiply with mma.sync m16n8k16 (bf16, fp32 accumulate), weights on the A side
(16 output rows x 16 k) and tokens on the B side.  In this layout one 16-byte load per lane gives the lane
its A fragments for two 16-row tiles x one 32-wide scale group, and every register of those fragments is one
`lop3` away: no shuffle, no shared memory, no repacking.

Rows come in pairs of 16-row tiles (m = 0, 1): for w13 [2i, k] pair p is (gate rows 16p..16p+15, up rows
16p..16p+15), so silu(gate) * up of a row is formed in the lane that holds both; for w2 [d, k] pair p is rows
32p..32p+31.  k is padded to kp = ceil(k / 256) * 256 (as the planar layout: padding q = 0, scale 0), in
groups c of 32.  Lane L = 4 g + u (g = L // 4, u = L % 4) of a warp owns, in group c, the 8 k values
32 c + 8 u + (0..7) of rows g and g + 8 of both tiles: 32 nibbles = 4 int32 words, word 2 m + s
(s = k step, 4 values each):

  nibble 0 | 4: row g,     k 32c + 8u + 4s + 0 | + 1   -> A register 0 (row g, logical cols 2u, 2u+1)
  nibble 1 | 5: row g + 8, k ... + 4s + 0 | + 1        -> A register 1
  nibble 2 | 6: row g,     k ... + 4s + 2 | + 3        -> A register 2 (row g, logical cols 2u+8, 2u+9)
  nibble 3 | 7: row g + 8, k ... + 4s + 2 | + 3        -> A register 3

so ((w >> 4r) & 0x000F000F) | 0x43004300 is A register r as a bf16 pair (128 + stored nibble).  The same k
permutation on the token side makes the lane's B fragments of both k steps one 16-byte load of the token row
(x[32c + 8u : 32c + 8u + 8]).  Values are stored q + 8 (checkpoint convention).

  packed [..., pairs, kp/32, 32 lanes, 4 words] int32       (pairs = rows / 32)
  scale  [..., pairs, kp/32, 8 (g), 4] in the scale dtype:  (tile 0 row g, tile 0 row g+8, tile 1 row g,
                                                             tile 1 row g+8) of the group

The lane's group is one scale group, so the kernel applies the four scales to the fp32 partial sums of the
group's two mma steps (exact q * x products; the scale multiply in fp32).
"""

from __future__ import annotations

import torch

from core.quant_int4 import pack_int4, unpack_int4
from plugins.moe_w4a16.layout import GROUP, padded_k

ROWS = 32  # rows per pair of 16-row tiles
LANES, WORDS, NIBBLES = 32, 4, 8


def _block_order() -> torch.Tensor:
    """[32 lanes * 4 words * 8 nibbles] -> flat index (row in the pair) * 32 + (k in the group)."""
    lane = torch.arange(LANES).view(LANES, 1, 1)
    word = torch.arange(WORDS).view(1, WORDS, 1)
    nib = torch.arange(NIBBLES).view(1, 1, NIBBLES)
    g, u = lane // 4, lane % 4
    m, s = word // 2, word % 2
    reg, hi = nib % 4, nib // 4
    row = 16 * m + g + 8 * (reg % 2)
    k = 8 * u + 4 * s + 2 * (reg // 2) + hi
    return (row * GROUP + k).reshape(-1)


def _scale_order() -> torch.Tensor:
    """[8 g * 4] -> row in the pair: (tile 0 row g, tile 0 row g + 8, tile 1 row g, tile 1 row g + 8)."""
    g = torch.arange(8).view(8, 1)
    q = torch.arange(4).view(1, 4)
    return (16 * (q // 2) + 8 * (q % 2) + g).reshape(-1)


BLOCK_ORDER = _block_order()  # a permutation of range(1024)
SCALE_ORDER = _scale_order()  # a permutation of range(32)


def pair_rows(n: int, gate_up: bool) -> torch.Tensor:
    """Row order of the pairs: gate_up (w13 [2i, k]): gate tile p then up tile p; else consecutive rows."""
    if gate_up:
        i = n // 2
        tiles = torch.arange(i).view(i // 16, 16)
        return torch.stack([tiles, tiles + i], dim=1).reshape(-1)  # [2i]
    return torch.arange(n)


def fits(n: int, gate_up: bool) -> bool:
    """Whether a weight with n rows has whole pairs (w13: i % 16 == 0; w2: d % 32 == 0)."""
    return n % ROWS == 0 and (not gate_up or (n // 2) % 16 == 0)


def to_fragments(q: torch.Tensor, scale: torch.Tensor, gate_up: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values q [..., n, k] in [-8, 7] and scales [..., n, k/32] -> (packed [..., n/32, kp/32, 32, 4] int32,
    scale [..., n/32, kp/32, 8, 4])."""
    *lead, n, k = q.shape
    if not fits(n, gate_up) or k % GROUP:
        raise ValueError(f"fragment layout: {'w13' if gate_up else 'w2'} [{n}, {k}] needs rows in whole 32-row pairs"
                         f"{' (i % 16 == 0)' if gate_up else ''} and k % {GROUP} == 0")
    if tuple(scale.shape) != (*lead, n, k // GROUP):
        raise ValueError(f"fragment layout: scale must be [..., {n}, {k // GROUP}], got {tuple(scale.shape)}")
    kp = padded_k(k)
    rows = pair_rows(n, gate_up).to(q.device)
    qp = torch.nn.functional.pad(q[..., rows, :], (0, kp - k))  # [..., n, kp]; padding q = 0
    blocks = qp.reshape(*lead, n // ROWS, ROWS, kp // GROUP, GROUP).transpose(-3, -2)  # [.., pairs, C, 32 r, 32 k]
    flat = blocks.reshape(*lead, n // ROWS, kp // GROUP, ROWS * GROUP)[..., BLOCK_ORDER.to(q.device)]
    packed = pack_int4(flat.contiguous()).reshape(*lead, n // ROWS, kp // GROUP, LANES, WORDS)
    sp = torch.nn.functional.pad(scale[..., rows, :], (0, (kp - k) // GROUP))  # [..., n, C]; padding scale 0
    sb = sp.reshape(*lead, n // ROWS, ROWS, kp // GROUP).transpose(-1, -2)  # [..., pairs, C, 32 rows]
    return packed, sb[..., SCALE_ORDER.to(q.device)].reshape(*lead, n // ROWS, kp // GROUP, 8, 4).contiguous()


def from_fragments(packed: torch.Tensor, scale: torch.Tensor, k: int, gate_up: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact inverse of to_fragments: -> (q [..., n, k] int8, scale [..., n, k/32])."""
    *lead, pairs, c, lanes, words = packed.shape
    n, kp = pairs * ROWS, c * GROUP
    if (lanes, words) != (LANES, WORDS) or k > kp or k % GROUP or tuple(scale.shape) != (*lead, pairs, c, 8, 4):
        raise ValueError(f"fragment layout: packed {tuple(packed.shape)} / scale {tuple(scale.shape)} do not hold "
                         f"[{n}, {k}] in 32-row pairs")
    flat = unpack_int4(packed.reshape(*lead, pairs, c, LANES * WORDS))  # [..., pairs, C, 1024] in block order
    blocks = torch.empty_like(flat)
    blocks[..., BLOCK_ORDER.to(packed.device)] = flat  # [..., pairs, C, 32 r * 32 k]
    q = blocks.reshape(*lead, pairs, c, ROWS, GROUP).transpose(-3, -2).reshape(*lead, n, kp)
    s = torch.empty_like(scale.reshape(*lead, pairs, c, ROWS))
    s[..., SCALE_ORDER.to(packed.device)] = scale.reshape(*lead, pairs, c, ROWS)
    s = s.transpose(-1, -2).reshape(*lead, n, c)
    inv = torch.argsort(pair_rows(n, gate_up)).to(packed.device)
    return q[..., inv, :k].contiguous(), s[..., inv, : k // GROUP].contiguous()


def dequantize_fragments(packed: torch.Tensor, scale: torch.Tensor, k: int, gate_up: bool) -> torch.Tensor:
    """Exact float32 weights [..., n, k] (the oracle's view of experts held in this layout)."""
    q, s = from_fragments(packed, scale, k, gate_up)
    return (q.to(torch.float32).unflatten(-1, (-1, GROUP)) * s.to(torch.float32).unsqueeze(-1)).flatten(-2)


def planar_to_fragments(packed: torch.Tensor, scale: torch.Tensor, k: int, gate_up: bool
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Planar (v2, layout.py) kernel form [..., n, kp/8] / [..., kp/32, n] -> this layout (exact)."""
    from plugins.moe_w4a16.layout import unrepack_int4
    ck_packed, ck_scale = unrepack_int4(packed, scale, k)
    return to_fragments(unpack_int4(ck_packed), ck_scale, gate_up)
