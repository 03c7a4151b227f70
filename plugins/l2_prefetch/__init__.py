"""l2_prefetch: weights into L2 ahead of the kernels that read them (sm_90's bulk prefetch; a hint, no result
depends on it).  `kdtree::l2_prefetch(weights)` is the decode round's form: up to four tensors in one launch that
joins the round's programmatic-dependent-launch chain (launch.prefetch_regions_l2); on CPU it does nothing.
The runtime calls it only with KDTREE_GEMM_PREFETCH=1 (runtime/model/attention.py), until benchmarks/
l2_prefetch.py and the rank benchmark show that the decode GEMMs gain from it.  See NOTES.md."""

from __future__ import annotations

import torch

from plugins.common.op import kdtree_op

__all__ = ["l2_prefetch", "l2_prefetch_op"]


def l2_prefetch(weights: list[torch.Tensor]) -> None:
    """Put up to four contiguous weight tensors in flight into L2 (see l2_prefetch_op)."""
    l2_prefetch_op(list(weights))


@kdtree_op("l2_prefetch", mutates_args=())
def l2_prefetch_op(weights: list[torch.Tensor]) -> None:
    """weights: up to four contiguous tensors of one device.  A hint for the kernels that will read them: on CUDA
    one launch of bulk L2 prefetches (plugins/l2_prefetch/l2_prefetch.cu), nothing elsewhere."""
    if len(weights) > 4:
        raise ValueError(f"l2_prefetch: at most 4 tensors, got {len(weights)}")


@l2_prefetch_op.register_kernel("cuda")
def _(weights):
    from plugins.l2_prefetch.launch import prefetch_regions_l2
    prefetch_regions_l2(weights)
