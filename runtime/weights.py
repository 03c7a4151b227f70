"""The target model's weights, grouped the way the forward pass uses them.

Shape vocabulary: d hidden, h heads, p qk_nope dims, r rope dims, c kv_lora_rank (latent),
u v_head_dim, q q_lora_rank, i intermediate, e routed experts, v vocab.
MLA is kept in its weight-absorbed form: kv_b [h*(p+u), c] is split into
w_uk [h, p, c] (q_nope -> latent) and w_uv [h, u, c] (latent -> value heads).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from build_pipeline.config import ModelConfig
from build_pipeline.loader import WeightLoader
from build_pipeline.progress import Progress
from build_pipeline.weight_map import target_specs


@dataclass
class AttentionWeights:
    q_a: torch.Tensor | None  # [q, d]   (None when q_lora_rank is null)
    q_a_norm: torch.Tensor | None  # [q]
    q_b: torch.Tensor  # [h*(p+r), q] or, without q_lora, q_proj [h*(p+r), d]
    kv_a: torch.Tensor  # [c+r, d]
    kv_a_norm: torch.Tensor  # [c]
    w_uk: torch.Tensor  # [h, p, c]
    w_uv: torch.Tensor  # [h, u, c]
    o: torch.Tensor  # [d, h*u]


@dataclass
class MLPWeights:
    gate_up: torch.Tensor  # [2i, d]  gate rows then up rows
    down: torch.Tensor  # [d, i]


@dataclass
class Int4Experts:
    """Routed experts in the moe_w4a16 kernel layout (build_pipeline/moe_layout.py); kp_x = x rounded
    up to 256."""
    w13: torch.Tensor  # [e, 2i, kp_d/8] int32
    w13_scale: torch.Tensor  # [e, kp_d/32, 2i]
    w2: torch.Tensor  # [e, d, kp_i/8] int32
    w2_scale: torch.Tensor  # [e, kp_i/32, d]

    @classmethod
    def from_checkpoint(cls, w13_packed: torch.Tensor, w13_scale: torch.Tensor, w2_packed: torch.Tensor,
                        w2_scale: torch.Tensor, group_size: int = 32,
                        device: str | torch.device | None = None) -> "Int4Experts":
        """From stacked checkpoint-form experts (weight_packed [e, out, in/8], weight_scale [e, out, in/g],
        as build_pipeline/shard.py stores them); scales become bf16 when that is exact."""
        from build_pipeline.moe_layout import repack_int4

        def one(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            b = scale.to(torch.bfloat16)
            scale = b if torch.equal(b.to(scale.dtype), scale) else scale
            p, s = repack_int4(packed, scale, group_size)
            return p.to(device or packed.device), s.to(device or packed.device)

        (a, sa), (b, sb) = one(w13_packed, w13_scale), one(w2_packed, w2_scale)
        return cls(a, sa, b, sb)


@dataclass
class MoEWeights:
    gate: torch.Tensor  # [e, d] fp32 router
    gate_bias: torch.Tensor  # [e] fp32 e_score_correction_bias
    w13: torch.Tensor  # [e, 2i, d] per-expert gate rows then up rows (dequantised when the checkpoint is INT4)
    w2: torch.Tensor  # [e, d, i]
    shared: MLPWeights | None
    int4: Int4Experts | None = None  # the same experts packed; the CUDA path reads these when present


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [d]
    attn: AttentionWeights
    mlp_norm: torch.Tensor  # [d]
    mlp: MLPWeights | MoEWeights


@dataclass
class TargetWeights:
    embed: torch.Tensor  # [v, d]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [d]
    lm_head: torch.Tensor  # [v, d]


def load_target_weights(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu", progress: bool = True) -> TargetWeights:
    """Stream the checkpoint into TargetWeights (router and its bias in at least fp32)."""
    loader = WeightLoader(model_dir, cfg.tensor_prefix, cfg.quant)
    specs = target_specs(cfg)
    flat: dict[str, torch.Tensor] = {}
    bar = Progress(len(specs), "loading weights", enabled=progress)
    for spec, tensor in loader.stream(specs, torch.float32):
        router = spec.key.endswith(("moe.gate", "moe.gate_bias"))
        keep = dtype if not router or dtype == torch.float64 else torch.float32  # router: at least fp32
        flat[spec.key] = tensor.to(device=device, dtype=keep)
        bar.advance()
    bar.close()
    return assemble_target_weights(cfg, flat)


def assemble_target_weights(cfg: ModelConfig, flat: dict[str, torch.Tensor]) -> TargetWeights:
    """Group a flat {our name: tensor} dict (weight_map keys) into TargetWeights."""
    h, p, u = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    layers = []
    for li in range(cfg.num_layers):
        pre = f"layers.{li}."
        kv_b = flat.pop(pre + "attn.kv_b").view(h, p + u, cfg.kv_lora_rank)  # [h, p+u, c]
        attn = AttentionWeights(
            q_a=flat.pop(pre + "attn.q_a", None),
            q_a_norm=flat.pop(pre + "attn.q_a_norm", None),
            q_b=flat.pop(pre + "attn.q_b") if cfg.q_lora_rank is not None else flat.pop(pre + "attn.q"),
            kv_a=flat.pop(pre + "attn.kv_a"),
            kv_a_norm=flat.pop(pre + "attn.kv_a_norm"),
            w_uk=kv_b[:, :p].contiguous(),
            w_uv=kv_b[:, p:].contiguous(),
            o=flat.pop(pre + "attn.o"),
        )
        if cfg.is_moe_layer(li):
            e = cfg.n_routed_experts
            experts = [_mlp(flat, pre + f"moe.experts.{j}.") for j in range(e)]
            mlp: MLPWeights | MoEWeights = MoEWeights(
                gate=flat.pop(pre + "moe.gate"),
                gate_bias=flat.pop(pre + "moe.gate_bias"),
                w13=torch.stack([x.gate_up for x in experts]),  # [e, 2i, d]
                w2=torch.stack([x.down for x in experts]),  # [e, d, i]
                shared=_mlp(flat, pre + "moe.shared.") if cfg.n_shared_experts else None,
            )
        else:
            mlp = _mlp(flat, pre + "mlp.")
        layers.append(LayerWeights(flat.pop(pre + "attn_norm"), attn, flat.pop(pre + "mlp_norm"), mlp))
    embed = flat.pop("embed")
    lm_head = embed if cfg.tie_word_embeddings else flat.pop("lm_head")
    return TargetWeights(embed=embed, layers=layers, norm=flat.pop("norm"), lm_head=lm_head)


def _mlp(flat: dict[str, torch.Tensor], pre: str) -> MLPWeights:
    gate, up = flat.pop(pre + "gate"), flat.pop(pre + "up")
    return MLPWeights(gate_up=torch.cat([gate, up], dim=0), down=flat.pop(pre + "down"))
