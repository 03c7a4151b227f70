"""The target model's forward pass (DeepSeek-V3 / Kimi K2.x) in plain torch, CPU and CUDA alike.

One entry point serves every mode: a prefill chunk (n prompt tokens, chain mask), an AR step
(n = 1) and a tree verification (n = 1 root + B nodes, ancestor mask).  It returns the final hidden
states and, for the drafter, the hidden states after the requested layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from build_pipeline.config import ModelConfig
from plugins.precision import acc
from runtime.attention import mla_forward
from runtime.cache import LatentCache
from runtime.layers import rms_norm, swiglu_mlp
from runtime.moe import moe_forward
from runtime.rope import Rope
from runtime.weights import MoEWeights, TargetWeights


class TargetModel:
    def __init__(self, cfg: ModelConfig, weights: TargetWeights, feature_layers: tuple[int, ...] = ()):
        """feature_layers: decoder-layer indices whose output hidden states forward() also returns."""
        self.cfg, self.w = cfg, weights
        self.device, self.dtype = weights.embed.device, weights.embed.dtype
        self.rope = Rope(cfg.rope, cfg.qk_rope_head_dim, cfg.rope_interleave, self.device)
        self.feature_layers = tuple(feature_layers)

    def new_cache(self, batch: int, capacity: int, tokens_per_forward: int) -> LatentCache:
        return LatentCache.allocate(self.cfg.num_layers, batch, capacity, tokens_per_forward, self.cfg.d_qk,
                                    self.dtype, self.device)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: LatentCache,
                tree_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens, positions [b, n]; tree_mask [b, n, w].

        Returns (hidden [b, n, d] after the final norm, features [b, n, f*d] or None), where features
        concatenates the outputs of feature_layers in order.  Writes the tokens' latent rows into
        cache.scratch[:, :, :n]; the committed cache is only read.
        """
        cfg = self.cfg
        x = F.embedding(tokens, self.w.embed)  # [b, n, d]
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        feats: dict[int, torch.Tensor] = {}
        for li, lw in enumerate(self.w.layers):
            a = mla_forward(cfg, lw.attn, self.rope, rms_norm(x, lw.attn_norm, cfg.rms_norm_eps), cos, sin,
                            cache.kv[li], cache.lens, cache.scratch[li], tree_mask)
            x = x + a
            hn = rms_norm(x, lw.mlp_norm, cfg.rms_norm_eps)
            if isinstance(lw.mlp, MoEWeights):
                x = x + moe_forward(cfg, lw.mlp, hn)
            else:
                x = x + swiglu_mlp(hn, lw.mlp.gate_up, lw.mlp.down)
            if li in self.feature_layers:
                feats[li] = x
        hidden = rms_norm(x, self.w.norm, cfg.rms_norm_eps)
        features = torch.cat([feats[i] for i in self.feature_layers], dim=-1) if feats else None
        return hidden, features

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., d] -> logits [..., v] (fp32, or fp64 for an fp64 model)."""
        return acc(F.linear(hidden, self.w.lm_head))


def load_target(model_dir, device: str = "cpu", dtype: torch.dtype | None = None,
                feature_layers: tuple[int, ...] = (), progress: bool = True) -> TargetModel:
    """Parse config.json, stream the weights onto `device` and build the model (fp32 on CPU, bf16 on CUDA)."""
    from build_pipeline.config import load_config
    from runtime.weights import load_target_weights

    cfg = load_config(model_dir)
    dtype = dtype or (torch.float32 if str(device) == "cpu" else torch.bfloat16)
    return TargetModel(cfg, load_target_weights(model_dir, cfg, dtype, device, progress), feature_layers)
