"""A target's fingerprint, which a DFlash drafter records as the target it was built or trained for.

The drafter shares the target's embedding and lm_head, so the embedding identifies the target: the
fingerprint is the sha256 of the first FINGERPRINT_ROWS rows of `embed` [v, d] rounded to bf16
(the same from a bf16 or fp32 copy, and held by rank 0 of a vocab-parallel split), 16 hex digits.
"""

from __future__ import annotations

import hashlib

import torch

FINGERPRINT_ROWS = 64


def embedding_fingerprint(embed: torch.Tensor) -> str:
    """embed [v, d] (any float dtype, any device; v >= FINGERPRINT_ROWS or the whole table) -> 16 hex digits."""
    rows = embed[:FINGERPRINT_ROWS].detach().to("cpu", torch.bfloat16).contiguous()  # [<=64, d]
    h = hashlib.sha256(f"{tuple(embed.shape[1:])}".encode())
    h.update(rows.view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]
