"""Scratch of the moe_w4a16 Triton path, sized from static shapes only, carved from one byte buffer.

t tokens, K = top_k slots per token, e_local experts held, d hidden, i expert intermediate, s = the
plan's k splits of gate_up (plan.py).  The caller allocates the buffer once for a capacity,
MoEWorkspace.allocate(max_tokens, top_k, e_local, d, i, dtype, device), and passes its .buffer to every
kdtree::moe_w4a16 call with t <= max_tokens and the same (top_k, e_local, d, i, dtype) on that device (one
buffer serves every MoE layer: they run one after another); each call carves its own views
(plugins/common/workspace.py).  The routing counts and the one-token kernel's sync words, always the first two
views, must be zero when a call starts: allocate zeroes the buffer and every call leaves them zero again (its
last kernel re-zeroes the counts, kdtree_moe_v3_one its sync words), which saves a memset launch per MoE layer;
a buffer made any other way must zero those two views (MoEWorkspace.carve(...).counts / .sync).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plugins.common.workspace import Spec, carve, workspace_bytes
from plugins.moe_w4a16.plan import KernelConfig, cdiv, launch_plan


@dataclass
class MoEWorkspace:
    """The scratch views of one moe_w4a16 call and the buffer they are carved from (allocate once for a
    capacity; pass .buffer to kdtree::moe_w4a16, which carves its call's views with carve)."""
    buffer: torch.Tensor    # [nbytes] uint8: every view below, 256-byte aligned
    counts: torch.Tensor    # [e_local + 1] int32 tokens per local expert | number of active experts: zero between
    #                         calls (allocate zeroes it; each call's combine kernel, or kdtree_moe_v3_one with
    #                         launch_v3.ONE_COMBINE, re-zeroes it after its last read)
    sync: torch.Tensor      # [2 K + 2i / 32] int32 kdtree_moe_v3_one's per-pick h counters and arrivals, then its
    #                         per-row-pair combine tickets: zero between calls
    active: torch.Tensor    # [e_local] int32 local ids of the active experts
    lists: torch.Tensor     # [e_local, t] int32 slot ids (token * K + j) per expert
    topk_idx: torch.Tensor  # [t * K] int32 global expert ids
    topk_w: torch.Tensor    # [t * K] fp32 routing weights
    out: torch.Tensor       # [t * K, d] x's dtype: weighted expert output per slot
    part: torch.Tensor      # [s, t * K, 2i] fp32 gate|up partial sums per k split
    h: torch.Tensor         # [t * K, i] x's dtype: silu(gate) * up per slot
    shared_f: torch.Tensor  # [d] fp32 one token's shared-expert down product, from kdtree_moe_v3_one (ONE_SHARED)

    @classmethod
    def allocate(cls, max_tokens: int, top_k: int, e_local: int, d: int, i: int, dtype: torch.dtype, device,
                 config: KernelConfig | None = None) -> "MoEWorkspace":
        """A buffer for every call with t <= max_tokens (the splits, hence the bytes, vary with t: the largest
        need is taken), carved for t = max_tokens."""
        if max_tokens < 1:
            raise ValueError(f"moe_w4a16: workspace capacity max_tokens must be >= 1, got {max_tokens}")
        need = max(cls.nbytes(t, top_k, e_local, d, i, dtype, device, config) for t in range(1, max_tokens + 1))
        buffer = torch.zeros(need, dtype=torch.uint8, device=device)  # counts start at zero (kept so by the op)
        return cls.carve(buffer, max_tokens, top_k, e_local, d, i, dtype,
                         launch_plan(max_tokens, top_k, e_local, d, i, device, config).splits)

    @classmethod
    def nbytes(cls, t: int, top_k: int, e_local: int, d: int, i: int, dtype: torch.dtype, device,
               config: KernelConfig | None = None) -> int:
        """Bytes one call with t tokens needs on `device` (its SM count sets the k splits)."""
        splits = launch_plan(t, top_k, e_local, d, i, device, config).splits
        return workspace_bytes(_specs(t, top_k, e_local, d, i, dtype, splits))

    @classmethod
    def carve(cls, buffer: torch.Tensor, t: int, top_k: int, e_local: int, d: int, i: int, dtype: torch.dtype,
              splits: int) -> "MoEWorkspace":
        """The views one call uses, from the start of buffer [nbytes] uint8 (ValueError when it is too small)."""
        call = f"t {t}, top_k {top_k}, e_local {e_local}, d {d}, i {i}, {dtype}, {splits} k splits"
        return cls(buffer, *carve(buffer, _specs(t, top_k, e_local, d, i, dtype, splits), "moe_w4a16", call))


def _specs(t: int, top_k: int, e_local: int, d: int, i: int, dtype: torch.dtype, splits: int) -> list[Spec]:
    """(shape, dtype) of the views, in MoEWorkspace's field order."""
    n_slots, i32 = t * top_k, torch.int32
    return [((e_local + 1,), i32), ((2 * top_k + cdiv(2 * i, 32),), i32), ((e_local,), i32), ((e_local, t), i32),
            ((n_slots,), i32), ((n_slots,), torch.float32), ((n_slots, d), dtype),
            ((splits, n_slots, 2 * i), torch.float32), ((n_slots, i), dtype), ((d,), torch.float32)]
