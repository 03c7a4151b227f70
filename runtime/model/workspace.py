"""ForwardWorkspace: the scratch of target forwards of up to b requests x n_max tokens, allocated once
with the latent cache (TargetModel.new_cache), so a forward inside a round allocates nothing for its
ops (DESIGN: ops take fixed-capacity buffers): the attention's latent output and lse, and the
kdtree::moe_w4a16 buffer that every MoE layer reuses in turn.

Letters: b requests, n tokens of this forward (<= n_max), h local heads, c latent (kv_lora_rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardWorkspace:
    o_lat: torch.Tensor  # [b * n_max * h * c] flat, x's dtype: viewed per forward as [b, n, h, c]
    lse: torch.Tensor  # [b * n_max * h] fp32: viewed as [b, n, h]
    moe: torch.Tensor | None  # uint8 MoEWorkspace buffer for b * n_max tokens; None: no MoE layer, or CPU

    @classmethod
    def allocate(cls, tokens: int, heads: int, latent: int, dtype: torch.dtype, device,
                 moe: torch.Tensor | None) -> "ForwardWorkspace":
        """tokens = b * n_max, the most one forward carries."""
        return cls(o_lat=torch.empty(tokens * heads * latent, dtype=dtype, device=device),
                   lse=torch.empty(tokens * heads, dtype=torch.float32, device=device), moe=moe)

    def attention(self, b: int, n: int, h: int, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous views o_lat [b, n, h, c] and lse [b, n, h] for one forward's attention."""
        if b * n * h * c > self.o_lat.numel():
            raise ValueError(f"forward of {b} x {n} tokens exceeds the workspace of {self.lse.numel() // h} tokens")
        return self.o_lat[:b * n * h * c].view(b, n, h, c), self.lse[:b * n * h].view(b, n, h)
