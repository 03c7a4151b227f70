"""The parallel plan (core/plan.py): rules per weight, slices, per-rank ranges, validation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from core.config import QuantConfig, parse_config
from core.errors import ConfigError
from core.plan import ParallelPlan, ShardRule
from build_pipeline.tiny import hf_config_dict
from core.weight_map import target_specs


def _cfg(**over):
    raw = dict(hf_config_dict("kimi"), model_type="deepseek_v3", **over)
    return parse_config(raw)


def test_every_weight_has_a_rule_and_shards_tile_the_tensor():
    cfg = _cfg()
    for ep in (False, True):
        plan = ParallelPlan(tp=4, ep=ep)
        plan.validate(cfg)
        for spec in target_specs(cfg):
            rule = plan.rule(spec.key)
            full = torch.randn(spec.shape)
            pieces = [plan.shard(spec.key, full, r) for r in range(4)]
            if rule.kind == "split":
                assert torch.equal(torch.cat(pieces, dim=rule.dim), full), spec.key
                assert all(p.is_contiguous() for p in pieces)
            else:
                assert all(p is full for p in pieces), spec.key


def test_rules_match_the_agreed_table():
    plan, ep = ParallelPlan(tp=2), ParallelPlan(tp=2, ep=True)
    for key in ("norm", "layers.1.attn_norm", "layers.1.mlp_norm", "layers.1.attn.q_a", "layers.1.attn.q_a_norm",
                "layers.1.attn.kv_a", "layers.1.attn.kv_a_norm", "layers.1.moe.gate", "layers.1.moe.gate_bias"):
        assert plan.rule(key) == ShardRule("replicate") == ep.rule(key), key
    for key in ("embed", "lm_head", "layers.1.attn.q_b", "layers.1.attn.q", "layers.1.attn.kv_b",
                "layers.0.mlp.gate", "layers.0.mlp.up", "layers.1.moe.shared.gate", "layers.1.moe.experts.3.up"):
        assert plan.rule(key) == ShardRule("split", 0), key
    for key in ("layers.1.attn.o", "layers.0.mlp.down", "layers.1.moe.shared.down", "layers.1.moe.experts.3.down"):
        assert plan.rule(key) == ShardRule("split", 1), key
    assert ep.rule("layers.1.moe.experts.3.down").kind == "experts"
    assert ep.rule("layers.1.moe.shared.down") == ShardRule("split", 1)  # shared expert TP-sliced in both modes
    with pytest.raises(KeyError, match="no rule"):  # stacked experts are build_pipeline/shard.py's output, not cut
        plan.rule("layers.1.moe.w13")
    with pytest.raises(KeyError, match="no rule"):
        plan.rule("layers.1.attn.mystery")


def test_heads_slices_are_whole_heads():
    cfg = _cfg()
    plan = ParallelPlan(tp=2)
    h, p, u, c = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    kv_b = torch.randn(h, p + u, c)
    piece = plan.shard("layers.1.attn.kv_b", kv_b.reshape(h * (p + u), c), 1)
    assert torch.equal(piece.view(h // 2, p + u, c), kv_b[h // 2:])
    assert plan.local_heads(cfg) == h // 2


def test_ranges():
    cfg = _cfg()
    plan = ParallelPlan(tp=4, ep=True)
    assert [plan.local_experts(cfg, r) for r in range(4)] == [(0, 4), (4, 4), (8, 4), (12, 4)]
    assert plan.expert_owner(cfg, 9) == 2
    assert plan.holds(cfg, "layers.1.moe.experts.9.gate", 2) and not plan.holds(cfg, "layers.1.moe.experts.9.gate", 1)
    assert ParallelPlan(tp=4).local_experts(cfg, 3) == (0, 16)
    assert [plan.vocab_range(cfg, r) for r in range(4)] == [(0, 256), (256, 512), (512, 768), (768, 1024)]
    one = torch.arange(6.0).view(2, 3)
    assert plan.shard("layers.1.moe.experts.9.gate", one, 2) is one  # an owned expert stays whole
    with pytest.raises(ValueError, match="rank 4 outside"):
        plan.vocab_range(cfg, 4)


def test_vocab_not_divisible_is_padded():
    cfg = _cfg(vocab_size=777)
    plan = ParallelPlan(tp=2)
    plan.validate(cfg)  # vocab 777 over 2 ranks: padded, not refused
    assert plan.vocab_rows(cfg) == 389 and [plan.vocab_range(cfg, r) for r in range(2)] == [(0, 389), (389, 777)]
    head = torch.arange(777.0)[:, None].expand(777, 3)  # [v, d]
    last = plan.shard("lm_head", head, 1)
    assert last.shape == (389, 3) and torch.equal(last[:388, 0], torch.arange(389.0, 777.0))
    assert not last[388].any()  # the padding row is zero


def test_round_trip():
    for plan in (ParallelPlan(), ParallelPlan(tp=8, ep=True)):
        assert ParallelPlan.from_dict(plan.to_dict()) == plan


@pytest.mark.parametrize("over,plan,msg", [
    (dict(num_attention_heads=6, num_key_value_heads=6), ParallelPlan(4),
     "--tp 4: num_attention_heads 6 is not divisible by 4"),
    (dict(vocab_size=1000), ParallelPlan(16), "--tp 16: num_attention_heads"),
    (dict(moe_intermediate_size=66), ParallelPlan(4), "--tp 4: moe_intermediate_size 66"),
    (dict(n_routed_experts=12), ParallelPlan(8, ep=True), "--tp 8 --ep: num_attention_heads"),
    (dict(num_attention_heads=8, n_routed_experts=12), ParallelPlan(8, ep=True), "--tp 8 --ep: n_routed_experts 12"),
    (dict(intermediate_size=258), ParallelPlan(4), "--tp 4: intermediate_size 258"),
])
def test_validate_names_key_and_flag(over, plan, msg):
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(")):
        plan.validate(_cfg(**over))


def test_validate_int4_groups():
    cfg = dataclasses.replace(_cfg(), quant=QuantConfig("int4", group_size=32))  # moe_intermediate_size 64
    ParallelPlan(2).validate(cfg)
    with pytest.raises(ConfigError, match=r"--tp 4: moe_intermediate_size 64 / 4 = 16 .* group_size 32"):
        ParallelPlan(4).validate(cfg)
    ParallelPlan(4, ep=True).validate(cfg)  # whole experts: no constraint
    with pytest.raises(ConfigError, match="--tp must be a positive integer"):
        ParallelPlan(0).validate(cfg)
