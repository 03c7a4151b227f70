"""L2 prefetches on a side branch of the forward: the weights of GEMMs a few kernels ahead put in flight from a second
stream that forks from the main one and joins it once, at the end of the forward.  No kernel of the round's PDL chain
waits for the prefetch kernel (the chain-node form, KDTREE_GEMM_PREFETCH, completes only after its predecessor and
sits between two chain kernels); the prefetch only needs SM room for its small CTAs while the chain's latency-bound
kernels (the attention and its glue) leave HBM idle.  A hint: no result depends on it.

KDTREE_GEMM_PREFETCH_SIDE=1 turns it on (off until measured: benchmarks/k26_switches.py `gemm_side`); inside a
CUDA graph capture the fork and the join become the graph's edges (torch's stream waits are captured as such).
"""

from __future__ import annotations

import torch

from core.env_flags import env_flag
from plugins.l2_prefetch.launch import prefetch_regions_l2

# KDTREE_GEMM_PREFETCH_SIDE=1: each layer's o_proj and next GEMMs' weights prefetched into L2 from a side branch
# that forks after the attention's latent norms (runtime/model/attention.py) and joins at the forward's end
ENABLED = env_flag("KDTREE_GEMM_PREFETCH_SIDE", False)
# KDTREE_GEMM_PREFETCH_NEXT_QKV=1 (with the side branch): also the next layer's q_a / kv_a weights (K2.6 TP8: 30 MB),
# forked after the MLP's norm, so they stream in under the router and the MoE, which leave HBM about two-thirds idle
# at t = 1 (runtime/model/target.py)
NEXT_QKV = env_flag("KDTREE_GEMM_PREFETCH_NEXT_QKV", False)
CHUNK = 8 << 10  # bytes a request: 31 MB a layer (K2.6 TP8: o_proj, router + shared gate_up, shared down) is ~3.9K,
THREADS = 32  # one warp a CTA: ~120 CTAs, so the requests go out from most SMs' copy engines side by side

_STREAMS: dict[int, torch.cuda.Stream] = {}


class SidePrefetch:
    """One forward's side branch on `device` (a CUDA device): prefetch() forks it from the current stream and puts
    up to four weights in flight into L2 there; join() makes the current stream wait for the branch (call it once at
    the forward's end, or a graph capture fails on the unjoined stream)."""

    def __init__(self, device: torch.device):
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        if index not in _STREAMS:  # one side stream a device, made at its first forward (the warm-up, run eagerly)
            _STREAMS[index] = torch.cuda.Stream(self.device)
        self.stream = _STREAMS[index]
        self.forked = False

    def prefetch(self, weights: list[torch.Tensor]) -> None:
        """Fork after the current stream's last kernel and prefetch the contiguous ones of `weights` (at most four)."""
        ws = [w for w in weights if w is not None and w.is_contiguous()][:4]
        if not ws:
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            prefetch_regions_l2(ws, chunk=CHUNK, threads=THREADS, chain=False)
        self.forked = True

    def join(self) -> None:
        """The current stream waits for the branch's work (nothing if it never forked)."""
        if self.forked:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self.forked = False
