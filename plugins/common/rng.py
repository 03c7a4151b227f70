"""Token choice inside a captured round: greedy, or a counter-based sample with device-held state.

torch's generators keep their state on the host (a CUDA graph would replay one fixed offset), so
the static round draws its randomness from a stateless hash instead: rng [b, 2] int64 = one (seed,
counter) per request lives on the device, each call hashes request r's (seed, counter) and each
element's index within request r's slice with splitmix64 into a uniform u, then advances every
counter in place.  A request's draws depend on its own state only, never on its row or its
neighbours, so a seeded request samples the same alone or in any batch.  A sample of
softmax(logits / T) is the exponential race argmax_i(logits_i / T - log(-log u_i)) (the Gumbel-max
trick), so it is exact and the same on CPU and GPU for the same logits, eager or replayed.  kdtree::posterior
(plugins/tree_accept/posterior.py) is choose fused into one GPU pass, with this as its CPU path.
"""

from __future__ import annotations

import torch

_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # as a signed int64
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 (multiplication wraps modulo 2^64)."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def uniform(rng: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """rng [b, 2] int64 (seed, counter) per request -> fp32 uniforms in (0, 1) of `shape` = (b, ...):
    request r's from its own state and the element's index within its slice; advances every counter."""
    numel = 1
    for s in shape[1:]:
        numel *= s
    base = _mix(rng[:, 0] * _GOLDEN + rng[:, 1])  # [b]
    z = _mix(base[:, None] + (torch.arange(numel, device=rng.device, dtype=torch.int64) + 1) * _GOLDEN)  # [b, numel]
    rng[:, 1].add_(1)
    u = (_shr(z, 40).to(torch.float32) + 0.5) * (2.0 ** -24)  # 24 random bits, never 0 or 1
    return u.view(shape)


def choose(logits: torch.Tensor, greedy: bool, rng: torch.Tensor, inv_temp: torch.Tensor) -> torch.Tensor:
    """logits [b, ..., v] -> token ids [b, ...] int64: argmax when greedy, else a sample of
    softmax(logits * inv_temp) per request (rng [b, 2] and inv_temp [b] fp32 on the device, so any
    T > 0 shares one graph)."""
    if greedy:
        return logits.argmax(dim=-1)
    u = uniform(rng, tuple(logits.shape))
    scale = inv_temp.view(-1, *([1] * (logits.dim() - 1)))  # [b, 1, ..., 1]
    race = logits.float() * scale - torch.log(-torch.log(u))  # [b, ..., v]
    return race.argmax(dim=-1)
