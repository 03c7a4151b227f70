"""Parameter count and memory by component, from the config alone (what `kdtree inspect` prints)."""

from __future__ import annotations

from core.config import ModelConfig


def component_params(cfg: ModelConfig) -> dict[str, int]:
    """Parameters per component: embedding, attention, dense MLP, router, routed/shared experts, norms, head."""
    d, h, qk = cfg.hidden_size, cfg.num_heads, cfg.qk_head_dim
    if cfg.q_lora_rank is None:
        q = h * qk * d
    else:
        q = cfg.q_lora_rank * d + cfg.q_lora_rank + h * qk * cfg.q_lora_rank
    attn = q + (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * d + cfg.kv_lora_rank \
        + h * (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank + d * h * cfg.v_head_dim
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    dense_layers = cfg.num_layers - moe_layers
    expert = 3 * d * cfg.moe_intermediate_size
    return {
        "embedding": cfg.vocab_size * d,
        "attention": cfg.num_layers * attn,
        "dense_mlp": dense_layers * 3 * d * cfg.intermediate_size,
        "router": moe_layers * (cfg.n_routed_experts * d + cfg.n_routed_experts),
        "routed_experts": moe_layers * cfg.n_routed_experts * expert,
        "shared_experts": moe_layers * cfg.n_shared_experts * expert,
        "norms": cfg.num_layers * 2 * d + d,
        "lm_head": 0 if cfg.tie_word_embeddings else cfg.vocab_size * d,
    }


def component_bytes(cfg: ModelConfig) -> dict[str, int]:
    """Bytes as stored: bf16 everywhere, INT4 routed experts at 4 bits + one bf16 scale per group
    (when the config says INT4), FP8 linears at 1 byte + one fp32 per block."""
    params = component_params(cfg)
    out = {k: 2 * v for k, v in params.items()}
    q = cfg.quant
    if q is not None and q.kind == "int4":
        out["routed_experts"] = params["routed_experts"] // 2 + 2 * params["routed_experts"] // q.group_size
    elif q is not None and q.kind == "fp8":
        per_block = 4 / (q.block[0] * q.block[1])
        for k in ("attention", "dense_mlp", "routed_experts", "shared_experts"):
            out[k] = int(params[k] * (1 + per_block))
    return out


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int = 2) -> int:
    """Latent cache bytes per token over all layers (c_kv | k_pe per layer)."""
    return cfg.num_layers * cfg.d_qk * dtype_bytes
