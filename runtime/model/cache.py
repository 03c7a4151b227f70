"""Latent KV cache of the target: one 576-wide row (c_kv 512 | k_pe 64 for Kimi) per token per layer.

Shapes: y layers, b requests, l_max capacity, n_max tokens per forward (tree nodes or prefill chunk).
A forward writes the new tokens' rows into `scratch`, never into `kv`; kv_commit then appends the
accepted ones (all of them for prefill and AR) to `kv` and advances `lens`.  `work` holds the other
per-forward buffers (runtime/model/workspace.py), allocated with the cache for the same b x n_max.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.model.workspace import ForwardWorkspace


@dataclass
class LatentCache:
    kv: torch.Tensor  # [y, b, l_max, d_qk] committed rows
    lens: torch.Tensor  # [b] int32 committed length per request
    scratch: torch.Tensor  # [y, b, n_max, d_qk] rows of the tokens of the current forward
    work: ForwardWorkspace  # the ops' scratch of one forward of up to b x n_max tokens

    @classmethod
    def allocate(cls, layers: int, batch: int, capacity: int, tokens_per_forward: int, d_qk: int,
                 dtype: torch.dtype, device: torch.device | str, work: ForwardWorkspace) -> "LatentCache":
        return cls(
            kv=torch.zeros(layers, batch, capacity, d_qk, dtype=dtype, device=device),
            lens=torch.zeros(batch, dtype=torch.int32, device=device),
            scratch=torch.zeros(layers, batch, tokens_per_forward, d_qk, dtype=dtype, device=device),
            work=work,
        )

    def request(self, r: int) -> "LatentCache":
        """Request r's cache as a batch of one (views; the workspace shared)."""
        return LatentCache(self.kv[:, r:r + 1], self.lens[r:r + 1], self.scratch[:, r:r + 1], self.work)

    @property
    def capacity(self) -> int:
        return self.kv.shape[2]

    @property
    def tokens_per_forward(self) -> int:
        return self.scratch.shape[2]
