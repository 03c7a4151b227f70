"""benchmarks/k26_ablate.py: its stand-ins fit the target's forward (shapes, finite values) and are undone after."""

from __future__ import annotations

import pytest
import torch


def test_ablations_parse_and_name_unknown_classes():
    from benchmarks.k26_ablate import parse_ablations

    assert parse_ablations("none,moe+gemm") == [("none", frozenset()), ("moe+gemm", frozenset({"moe", "gemm"}))]
    with pytest.raises(ValueError, match=r"unknown class \['turbo'\]"):
        parse_ablations("none,turbo")


def test_each_stand_in_runs_the_tiny_forward_and_is_restored():
    from benchmarks.k26_ablate import CLASSES, ablated
    from runtime.bench_rank import load_rank_models
    from runtime.model import attention, layers, moe, target

    model, _, _, _ = load_rank_models("tiny-kimi", 1, 0, None, 0, torch.device("cpu"), False)
    cache = model.new_cache(1, 64, 4)
    tokens, positions = torch.tensor([[1, 2, 3]]), torch.tensor([[0, 1, 2]])
    mask = torch.tensor([[[1], [3], [7]]])  # [1, 3, 1] chain: each token sees itself and the ones before
    real = {(m, a): getattr(m, a) for m in (attention, layers, moe, target)
            for a in ("linear", "tree_verify_mla", "mla_rope_kv", "mla_q_absorb", "mla_v_absorb", "add_rms_norm",
                      "moe_w4a16") if hasattr(m, a)}
    full, _ = model.forward(tokens, positions, cache, mask)
    for names in [frozenset({c}) for c in CLASSES] + [frozenset(CLASSES)]:
        with ablated(names):
            hidden, _ = model.forward(tokens, positions, cache, mask)
        assert hidden.shape == full.shape and torch.isfinite(hidden.float()).all(), names
        assert all(getattr(m, a) is f for (m, a), f in real.items()), names
    again, _ = model.forward(tokens, positions, cache, mask)
    assert torch.equal(again, full)


def test_forward_flops_count_each_class_of_work_once():
    """runtime/bench_rank._forward_flops on the tiny K2.6-structured rank: 2 flops a multiply-add of each weight
    matrix per token, each token's top_k expert slots, its attention over the committed rows (d_qk scores, latent
    values), linear in the tokens; the rooflines take the longer of bytes and flops per class."""
    from runtime.bench_rank import _forward_flops, _roofline_us
    from runtime.model.weights import MoEWeights

    model, _, _, _ = load_rank_models_cpu()
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
    assert _roofline_us("cpu", 4.25e6, 0) == _roofline_us("cpu", 4.25e6, 687e3) == 1.0  # bytes' time the longer
    assert _roofline_us("cpu", 0, 687e6 * 2) == 2.0  # flops' time the longer


def load_rank_models_cpu():
    from runtime.bench_rank import load_rank_models

    return load_rank_models("tiny-kimi", 1, 0, None, 0, torch.device("cpu"), False)
