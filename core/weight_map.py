"""The one declarative table from checkpoint tensor names to ours, with the shape each must have.

Our names (left) are what build_pipeline/shard.py reads and cuts into each rank's files; checkpoint
names (right) are the DeepSeek-V3 / Kimi K2.x layout that transformers' save_pretrained and Moonshot both write
(one tensor per routed expert).  A kimi_k25 checkpoint prefixes every name with `language_model.`
(config.tensor_prefix); MTP layers (index >= num_layers) and the vision tower are never listed, so
they are never read.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.config import ModelConfig


@dataclass(frozen=True, slots=True)
class TensorSpec:
    key: str  # our name, e.g. "layers.3.attn.kv_b"
    ckpt: str  # checkpoint name (without tensor_prefix), e.g. "model.layers.3.self_attn.kv_b_proj.weight"
    shape: tuple[int, ...]
    linear: bool  # a linear layer's weight: may be stored INT4 (weight_packed) or FP8 (weight_scale_inv)


def target_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """Every tensor the target model reads, in checkpoint order (embeddings, layers, head)."""
    d, h, v = cfg.hidden_size, cfg.num_heads, cfg.vocab_size
    qk, d_c, d_r = cfg.qk_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    specs = [TensorSpec("embed", "model.embed_tokens.weight", (v, d), False)]

    def add(key: str, ckpt: str, shape: tuple[int, ...], linear: bool = True) -> None:
        specs.append(TensorSpec(key, ckpt, shape, linear))

    for i in range(cfg.num_layers):
        p, c = f"layers.{i}.", f"model.layers.{i}."
        add(p + "attn_norm", c + "input_layernorm.weight", (d,), False)
        if cfg.q_lora_rank is None:
            add(p + "attn.q", c + "self_attn.q_proj.weight", (h * qk, d))
        else:
            add(p + "attn.q_a", c + "self_attn.q_a_proj.weight", (cfg.q_lora_rank, d))
            add(p + "attn.q_a_norm", c + "self_attn.q_a_layernorm.weight", (cfg.q_lora_rank,), False)
            add(p + "attn.q_b", c + "self_attn.q_b_proj.weight", (h * qk, cfg.q_lora_rank))
        add(p + "attn.kv_a", c + "self_attn.kv_a_proj_with_mqa.weight", (d_c + d_r, d))
        add(p + "attn.kv_a_norm", c + "self_attn.kv_a_layernorm.weight", (d_c,), False)
        add(p + "attn.kv_b", c + "self_attn.kv_b_proj.weight", (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), d_c))
        add(p + "attn.o", c + "self_attn.o_proj.weight", (d, h * cfg.v_head_dim))
        add(p + "mlp_norm", c + "post_attention_layernorm.weight", (d,), False)
        if not cfg.is_moe_layer(i):
            _mlp(add, p + "mlp.", c + "mlp.", d, cfg.intermediate_size)
            continue
        e, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
        add(p + "moe.gate", c + "mlp.gate.weight", (e, d), False)
        add(p + "moe.gate_bias", c + "mlp.gate.e_score_correction_bias", (e,), False)
        for j in range(e):
            _mlp(add, p + f"moe.experts.{j}.", c + f"mlp.experts.{j}.", d, inter)
        if cfg.n_shared_experts:
            _mlp(add, p + "moe.shared.", c + "mlp.shared_experts.", d, inter * cfg.n_shared_experts)
    add("norm", "model.norm.weight", (d,), False)
    if not cfg.tie_word_embeddings:
        add("lm_head", "lm_head.weight", (v, d))
    return specs


def _mlp(add, key: str, ckpt: str, d: int, inter: int) -> None:
    add(key + "gate", ckpt + "gate_proj.weight", (inter, d))
    add(key + "up", ckpt + "up_proj.weight", (inter, d))
    add(key + "down", ckpt + "down_proj.weight", (d, inter))


def drafter_specs(dcfg, target_hidden: int) -> list[TensorSpec]:
    """Every tensor of a DFlash drafter (no embeddings or lm_head: the target's are shared).
    z-lab's checkpoints carry no `model.` prefix; the loader also accepts one."""
    h, hd, kv, d, i = dcfg.num_heads, dcfg.head_dim, dcfg.num_kv_heads, dcfg.hidden_size, dcfg.intermediate_size
    specs = [TensorSpec("fc", "fc.weight", (d, len(dcfg.target_layer_ids) * target_hidden), True),
             TensorSpec("hidden_norm", "hidden_norm.weight", (d,), False)]
    for li in range(dcfg.num_layers):
        p = f"layers.{li}."
        specs += [
            TensorSpec(p + "attn_norm", p + "input_layernorm.weight", (d,), False),
            TensorSpec(p + "q", p + "self_attn.q_proj.weight", (h * hd, d), True),
            TensorSpec(p + "k", p + "self_attn.k_proj.weight", (kv * hd, d), True),
            TensorSpec(p + "v", p + "self_attn.v_proj.weight", (kv * hd, d), True),
            TensorSpec(p + "o", p + "self_attn.o_proj.weight", (d, h * hd), True),
            TensorSpec(p + "q_norm", p + "self_attn.q_norm.weight", (hd,), False),
            TensorSpec(p + "k_norm", p + "self_attn.k_norm.weight", (hd,), False),
            TensorSpec(p + "mlp_norm", p + "post_attention_layernorm.weight", (d,), False),
            TensorSpec(p + "gate", p + "mlp.gate_proj.weight", (i, d), True),
            TensorSpec(p + "up", p + "mlp.up_proj.weight", (i, d), True),
            TensorSpec(p + "down", p + "mlp.down_proj.weight", (d, i), True),
        ]
    specs.append(TensorSpec("norm", "norm.weight", (d,), False))
    return specs
