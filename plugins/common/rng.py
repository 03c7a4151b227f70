"""Token choice inside a captured round: greedy, or a counter-based sample with device-held state.

torch's generators keep their state on the host (a CUDA graph would replay one fixed offset), so
the static round draws its randomness from a stateless hash instead: rng [2] int64 = (seed,
counter) lives on the device, each call hashes (seed, counter, element index) with splitmix64
into a uniform u, then advances the counter in place.  A sample of softmax(logits / T) is the
exponential race argmax_i(logits_i / T - log(-log u_i)) (the Gumbel-max trick), so it is exact and
the same on CPU and GPU for the same logits, eager or replayed.  kdtree::posterior
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
    """rng [2] int64 (seed, counter) -> fp32 uniforms in (0, 1) of `shape`; advances the counter."""
    numel = 1
    for s in shape:
        numel *= s
    base = _mix(rng[0:1] * _GOLDEN + rng[1:2])  # [1]
    z = _mix(base + (torch.arange(numel, device=rng.device, dtype=torch.int64) + 1) * _GOLDEN)  # [numel]
    rng[1:2].add_(1)
    u = (_shr(z, 40).to(torch.float32) + 0.5) * (2.0 ** -24)  # 24 random bits, never 0 or 1
    return u.view(shape)


def choose(logits: torch.Tensor, greedy: bool, rng: torch.Tensor, inv_temp: torch.Tensor) -> torch.Tensor:
    """logits [..., v] -> token ids [...] int64: argmax when greedy, else a sample of
    softmax(logits * inv_temp) (inv_temp [1] fp32 on the device, so any T > 0 shares one graph)."""
    if greedy:
        return logits.argmax(dim=-1)
    u = uniform(rng, tuple(logits.shape))
    race = logits.float() * inv_temp - torch.log(-torch.log(u))  # [..., v]
    return race.argmax(dim=-1)
