"""SoloRankComm: one rank of a TP group run alone, to measure that rank's own work on one GPU.

Until a node's GPUs are lent, the per-rank cost of a TP8 model is measured by running rank r's shard
by itself (runtime/bench_rank.py).  The collectives then have no peers: all_reduce returns this
rank's partial sum unchanged, all_gather repeats this rank's piece `world` times (the output has the
full shape; the all-gather's write of it is kept).  So the rank runs exactly its kernels on exactly
its shapes, while the model it computes is not the TP model (the other ranks' contributions are
missing): its tokens are deterministic and AR / DDTree still agree, but they are not the tokens of
the whole model.  The collectives' cost is not in the measured time: the bench models it (2 x layers
all-reduces per forward at a stated latency) and says so.  Never used to serve.
"""

from __future__ import annotations

import torch

from runtime.parallel.comm import Comm


class SoloRankComm(Comm):
    """Rank `rank` of a group of `world`, with no peers (see the module doc)."""

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self._calls += 1
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat([t] * self.world, dim=dim) if self.world > 1 else t

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        return t

    def barrier(self) -> None:
        return None

    @property
    def collectives(self) -> int:
        """all_reduce calls issued so far (the bench counts them per forward)."""
        return self._calls
