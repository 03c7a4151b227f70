"""runtime/bench_rank's rooflines (CPU): what a verify forward must compute, by class, on the tiny rank."""

from __future__ import annotations

import pytest
import torch


def test_forward_flops_count_each_class_of_work_once():
    """runtime/bench_rank._forward_flops on the tiny K2.6-structured rank: 2 flops a multiply-add of each weight
    matrix per token, each token's top_k expert slots, its attention over the committed rows (d_qk scores, latent
    values), linear in the tokens; the rooflines take the longer of bytes and flops per class."""
    from runtime.bench_rank import _forward_flops, _roofline_us, load_rank_models
    from runtime.model.weights import MoEWeights

    model, _, _, _ = load_rank_models("tiny-kimi", 1, 0, None, 0, torch.device("cpu"), False)
    cfg, ctx = model.cfg, 48
    one, five = _forward_flops(model, ctx, 1), _forward_flops(model, ctx, 5)
    assert all(five[k] == 5 * one[k] for k in one) and set(one) == {"dense", "router", "experts", "cache", "lm_head"}
    moe = sum(isinstance(lw.mlp, MoEWeights) for lw in model.w.layers)
    assert 0 < moe < cfg.num_layers  # the first layers dense, as K2.6's
    i = cfg.moe_intermediate_size
    assert one["experts"] == 2 * cfg.num_experts_per_tok * 3 * cfg.hidden_size * i * moe
    assert one["router"] == 2 * cfg.n_routed_experts * cfg.hidden_size * moe
    assert one["lm_head"] == 2 * cfg.vocab_size * cfg.hidden_size
    assert one["cache"] == 2 * cfg.num_heads * ctx * (cfg.d_qk + cfg.kv_lora_rank) * cfg.num_layers
    mats = sum(t.numel() for lw in model.w.layers for t in vars(lw.attn).values() if t is not None and t.dim() == 2)
    assert one["dense"] > 2 * mats  # the attention's matrices, and the dense and shared MLPs beside them
    assert _roofline_us("cpu", 4.25e6, 0) == _roofline_us("cpu", 4.25e6, 687e3) == pytest.approx(1.0)  # bytes
    assert _roofline_us("cpu", 4.25e6, 687e6 * 2) == pytest.approx(2.0)  # flops' time the longer

