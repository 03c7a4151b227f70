"""Test oracle: a checkpoint's own tensors, read by core.loader.WeightLoader, never through the build.

The runtime loads weights one way only (checkpoint -> `kdtree build` artifact -> runtime/load/), so the
tests that hold an artifact to its checkpoint need an independent view of the checkpoint: every
weight_map key dequantised exactly to `dtype` (`checkpoint_tensors`), or those tensors grouped into
an unsharded TargetModel with dense experts (`checkpoint_model`) as the reference forward pass.
"""

from __future__ import annotations

from pathlib import Path

import torch

from core.config import ModelConfig, load_config
from core.loader import WeightLoader
from core.weight_map import target_specs
from runtime.model.target import TargetModel
from runtime.model.weights import (
    AttentionWeights,
    Experts,
    LayerWeights,
    MLPWeights,
    MoEWeights,
    TargetWeights,
)


def checkpoint_tensors(path: str | Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """{weight_map key: tensor} of every target weight, INT4 / FP8 dequantised exactly (fp32) first; the
    router (moe.gate, moe.gate_bias) in at least fp32, as runtime/load/artifact.py keeps it."""
    cfg = load_config(path)
    loader = WeightLoader(path, cfg.tensor_prefix, cfg.quant)
    router = torch.float64 if dtype == torch.float64 else torch.float32
    return {spec.key: t.to(router if spec.key.endswith(("moe.gate", "moe.gate_bias")) else dtype)
            for spec, t in loader.stream(target_specs(cfg), torch.float32)}


def checkpoint_weights(cfg: ModelConfig, flat: dict[str, torch.Tensor]) -> TargetWeights:
    """Group checkpoint_tensors' output into whole (tp 1) TargetWeights: kv_b split into w_uk / w_uv,
    experts stacked dense [e, 2i, d] / [e, d, i]."""
    h, p, u, c = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank

    def mlp(pre: str) -> MLPWeights:
        return MLPWeights(torch.cat([flat[pre + "gate"], flat[pre + "up"]]), flat[pre + "down"])  # [2i, d], [d, i]

    layers = []
    for li in range(cfg.num_layers):
        pre = f"layers.{li}."
        kv_b = flat[pre + "attn.kv_b"].view(h, p + u, c)  # [h, p+u, c]
        q_lora = cfg.q_lora_rank is not None
        attn = AttentionWeights(
            q_a=flat[pre + "attn.q_a"] if q_lora else None, q_a_norm=flat[pre + "attn.q_a_norm"] if q_lora else None,
            q_b=flat[pre + ("attn.q_b" if q_lora else "attn.q")], kv_a=flat[pre + "attn.kv_a"],
            kv_a_norm=flat[pre + "attn.kv_a_norm"], w_uk=kv_b[:, :p].contiguous(), w_uv=kv_b[:, p:].contiguous(),
            o=flat[pre + "attn.o"])
        if cfg.is_moe_layer(li):
            experts = [mlp(pre + f"moe.experts.{j}.") for j in range(cfg.n_routed_experts)]
            dense = Experts(torch.stack([x.gate_up for x in experts]), None,  # [e, 2i, d]
                            torch.stack([x.down for x in experts]), None)  # [e, d, i]
            m: MLPWeights | MoEWeights = MoEWeights(
                gate=flat[pre + "moe.gate"], gate_bias=flat[pre + "moe.gate_bias"],
                experts=dense, shared=mlp(pre + "moe.shared.") if cfg.n_shared_experts else None)
        else:
            m = mlp(pre + "mlp.")
        layers.append(LayerWeights(flat[pre + "attn_norm"], attn, flat[pre + "mlp_norm"], m))
    embed = flat["embed"]
    return TargetWeights(embed=embed, layers=layers, norm=flat["norm"],
                         lm_head=embed if cfg.tie_word_embeddings else flat["lm_head"])


def checkpoint_model(path: str | Path, dtype: torch.dtype = torch.float32,
                     feature_layers: tuple[int, ...] = ()) -> TargetModel:
    """The whole model straight from the checkpoint's tensors (dense experts), on the CPU."""
    cfg = load_config(path)
    return TargetModel(cfg, checkpoint_weights(cfg, checkpoint_tensors(path, dtype)), feature_layers)
