"""The moe_w4a16 kernel layout of INT4 experts, and the build-time repacking into it from the checkpoint format.

Checkpoint (compressed-tensors `pack-quantized`, see core/quant_int4.py), per expert weight W [n, k]:
  weight_packed [n, k/8] int32: word w holds k = 8w .. 8w+7, value j in bits 4j..4j+3, stored q + 8;
  weight_scale  [n, k/32]: W[o, c] = q[o, c] * scale[o, c // 32].

Kernel layout ("planar blocks"), per expert, with k padded to kp = ceil(k / 256) * 256:
  packed [n, kp/8] int32: the row is cut into blocks of 256 values = 32 words; word j of block b holds
    in nibble p (bits 4p..4p+3) the value at k = 256 b + 32 p + j, stored q + 8 (padding: q = 0);
  scale  [kp/32, n] (group-major, the checkpoint's dtype; padding groups 0).

Why: nibble plane p of a [rows, 32-word] tile, ((w >> 4p) & 0xF), is already a K-contiguous
[rows, 32] matrix covering exactly one scale group (8b + p).  The kernel turns it into bf16 with
elementwise bit operations only (no reshape/join of registers, so the load's layout can feed the
tensor-core operand directly), multiplies by x[:, 256 b + 32 p : +32], and applies the group's
scale once to the [rows, tokens] partial sum.  A block row is 128 contiguous bytes (one cache line,
eight 16-byte loads); the scales of one group for consecutive output rows are contiguous, so a tile
of rows reads its scales in whole 32-byte sectors.
"""

from __future__ import annotations

import torch

from core.quant_int4 import pack_int4, unpack_int4

GROUP = 32  # the kernel's scale group = plane width (values per nibble plane of a block)
PLANES = 8  # nibbles per int32 word
BLOCK_K = GROUP * PLANES  # 256 values of k per block


def padded_k(k: int) -> int:
    """k rounded up to the kernel's block of 256 values."""
    return -(-k // BLOCK_K) * BLOCK_K


def repack_int4(packed: torch.Tensor, scale: torch.Tensor, group_size: int = GROUP
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint form -> kernel form, for one weight or a stack of experts.

    packed [..., n, k/8] int32, scale [..., n, k/32]  ->  packed [..., n, kp/8] int32, scale [..., kp/32, n].
    """
    if group_size != GROUP:
        raise ValueError(f"repack_int4: the kernel layout needs group size {GROUP}, got {group_size}")
    if packed.dtype != torch.int32:
        raise TypeError(f"repack_int4: packed must be int32, got {packed.dtype}")
    *lead, n, kw = packed.shape
    k = kw * 8
    if k % GROUP:
        raise ValueError(f"repack_int4: k = {k} is not a multiple of the group size {GROUP}")
    if tuple(scale.shape) != (*lead, n, k // GROUP):
        raise ValueError(f"repack_int4: scale must be [..., {n}, {k // GROUP}] for packed {tuple(packed.shape)}, "
                         f"got {tuple(scale.shape)}")
    kp = padded_k(k)
    q = unpack_int4(packed)  # [..., n, k] int8
    q = torch.nn.functional.pad(q, (0, kp - k))  # [..., n, kp]; padding q = 0
    planar = q.reshape(*lead, n, kp // BLOCK_K, PLANES, GROUP).transpose(-1, -2)  # [..., n, blocks, 32 (j), 8 (p)]
    out_packed = pack_int4(planar.reshape(*lead, n, kp).contiguous())  # [..., n, kp/8]
    s = torch.nn.functional.pad(scale, (0, (kp - k) // GROUP))  # [..., n, kp/32]; padding scale 0
    return out_packed, s.transpose(-1, -2).contiguous()  # [..., kp/32, n]


def unrepack_int4(packed: torch.Tensor, scale: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel form -> checkpoint form (exact inverse of repack_int4 for the true k)."""
    *lead, n, kpw = packed.shape
    kp = kpw * 8
    if kp % BLOCK_K or k > kp or k % GROUP:
        raise ValueError(f"unrepack_int4: packed k {kp} is not a multiple of {BLOCK_K} or k = {k} does not fit")
    planar = unpack_int4(packed).reshape(*lead, n, kp // BLOCK_K, GROUP, PLANES)  # [..., n, blocks, j, p]
    q = planar.transpose(-1, -2).reshape(*lead, n, kp)[..., :k]  # [..., n, k]
    return pack_int4(q.contiguous()), scale.transpose(-1, -2)[..., : k // GROUP].contiguous()


def dequantize_kernel_layout(packed: torch.Tensor, scale: torch.Tensor, k: int) -> torch.Tensor:
    """Exact float32 weights [..., n, k] from the kernel form (the oracle's view of the packed experts;
    the CPU reference calls it per MoE call, so it works on the planar words directly: one shift and
    mask, one multiply by the broadcast group scale)."""
    *lead, n, kpw = packed.shape
    kp = kpw * 8
    words = packed.reshape(*lead, n, kp // BLOCK_K, GROUP, 1)  # [..., n, blocks, 32 (j), 1]
    shifts = torch.arange(0, 4 * PLANES, 4, dtype=torch.int32, device=packed.device)  # [8 (p)]
    q = ((words >> shifts) & 0xF).transpose(-1, -2).to(torch.float32) - 8.0  # [..., n, blocks, 8 (p), 32 (j)]
    s = scale.to(torch.float32).transpose(-1, -2).reshape(*lead, n, kp // BLOCK_K, PLANES, 1)  # group 8b + p
    return (q * s).reshape(*lead, n, kp)[..., :k]  # value k = 256 b + 32 p + j


def pack_experts(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values [e, n, k] in [-8, 7] and scales [e, n, k/32] -> kernel form (via the checkpoint form)."""
    return repack_int4(pack_int4(q), scale)
