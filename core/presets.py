"""Reference configs of real models, in their published config.json form (for sizing, tests and
K2.6-shaped random builds on the GPU machine; no weights are shipped)."""

from __future__ import annotations

KIMI_K26_TEXT = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "kimi_k2",
    "vocab_size": 163840,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_shared_experts": 1,
    "n_routed_experts": 384,
    "routed_scaling_factor": 2.827,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc",
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 8,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "hidden_act": "silu",
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-5,
    "rope_theta": 50000.0,
    "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "attention_bias": False,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "pad_token_id": 163839,
    "torch_dtype": "bfloat16",
}

KIMI_K26_CONFIG = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "text_config": KIMI_K26_TEXT,
    "vision_config": {"model_type": "moonvit"},
    "quantization_config": {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
            "dynamic": False, "actorder": None, "observer": "minmax"}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*",
                   "re:.*vision_tower.*", "re:.*mm_projector.*"],
    },
}

# The Kimi K2.5/K2.6 DFlash drafter's geometry (public conversions of z-lab's configs, DESIGN.md):
# 6 Qwen3-style layers, hidden 7168, 64 query / 8 kv heads of 128, MLP 18432, block 8, YaRN like the
# target.  Assumed where the public configs are silent: head_dim 128 (Qwen3's), rms_norm_eps 1e-6.
KIMI_K26_DRAFTER = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_size": 7168,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 18432,
    "num_hidden_layers": 6,
    "rms_norm_eps": 1e-6,
    "vocab_size": 163840,
    "hidden_act": "silu",
    "rope_theta": 50000.0,
    "rope_scaling": KIMI_K26_TEXT["rope_scaling"],
    "max_position_embeddings": 262144,
    "dflash_config": {"block_size": 8, "mask_token_id": 163838, "target_layer_ids": [1, 12, 24, 35, 47, 58]},
}
