"""Token choice from logits: greedy at temperature 0, else a sample of softmax(logits / T)."""

from __future__ import annotations

import torch

from plugins.precision import acc


def sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """logits [..., v] fp32 -> token ids [...] int64."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(acc(logits) / temperature, dim=-1)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])
