"""Config parsing: the three dialects, refusals naming the key, and K2.6's size."""

from __future__ import annotations

import copy
import json

import pytest

from core.config import load_config, parse_config
from core.errors import ConfigError
from core.model_stats import component_params
from core.presets import KIMI_K26_CONFIG


def test_kimi_k26_config_parses_and_counts_about_1_03_trillion_params():
    cfg = parse_config(copy.deepcopy(KIMI_K26_CONFIG))
    assert cfg.model_type == "kimi_k25" and cfg.tensor_prefix == "language_model."
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.n_routed_experts) == (7168, 61, 64, 384)
    assert cfg.quant.kind == "int4" and cfg.quant.group_size == 32
    assert cfg.d_qk == 576 and cfg.d_v == 512
    total = sum(component_params(cfg).values())
    assert 1.02e12 < total < 1.04e12, total
    # DESIGN.md: softmax scale = 192^-0.5 * m^2 with m = 0.1 ln 64 + 1
    assert cfg.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * __import__("math").log(64) + 1) ** 2)


@pytest.mark.parametrize("key,value", [
    ("hidden_act", "gelu"), ("scoring_func", "softmax"), ("topk_method", "greedy"), ("moe_layer_freq", 2),
    ("n_group", 5), ("qk_rope_head_dim", 63), ("num_attention_heads", 0), ("attention_bias", True),
])
def test_unsupported_values_are_refused_naming_the_key(key, value):
    raw = copy.deepcopy(KIMI_K26_CONFIG)
    raw["text_config"][key] = value
    with pytest.raises(ConfigError, match=key):
        parse_config(raw)


def test_unsupported_rope_and_quant_are_refused():
    raw = copy.deepcopy(KIMI_K26_CONFIG)
    raw["text_config"]["rope_scaling"] = {"type": "dynamic", "factor": 2.0}
    with pytest.raises(ConfigError, match="rope_scaling"):
        parse_config(raw)
    raw = copy.deepcopy(KIMI_K26_CONFIG)
    raw["quantization_config"]["format"] = "float-quantized"
    with pytest.raises(ConfigError, match="quantization_config.format"):
        parse_config(raw)
    raw = copy.deepcopy(KIMI_K26_CONFIG)
    raw["model_type"] = "llama"
    with pytest.raises(ConfigError, match="model_type"):
        parse_config(raw)


def test_missing_key_is_named(tmp_path):
    raw = copy.deepcopy(KIMI_K26_CONFIG)
    del raw["text_config"]["kv_lora_rank"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="text_config.kv_lora_rank"):
        load_config(tmp_path)


def test_fp8_and_null_q_lora_and_no_rope_scaling():
    raw = copy.deepcopy(KIMI_K26_CONFIG["text_config"])
    raw.update(model_type="kimi_k2", q_lora_rank=None, rope_scaling=None,
               quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                    "activation_scheme": "dynamic"})
    cfg = parse_config(raw)
    assert cfg.q_lora_rank is None and cfg.rope.kind == "default" and cfg.quant.block == (128, 128)
    assert cfg.tensor_prefix == ""


def test_transformers5_dialect(tiny):
    cfg = load_config(tiny.get("grouped"))
    assert cfg.n_group == 4 and cfg.topk_group == 2 and cfg.rope.kind == "yarn" and cfg.rope.factor == 8.0
    assert cfg.to_dict() == type(cfg).from_dict(cfg.to_dict()).to_dict()
