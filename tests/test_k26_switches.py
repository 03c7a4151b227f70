"""benchmarks/k26_switches.py's settings (the GPU run is tests/test_k26_rank.py::test_switches_ab_on_artifact)."""

from __future__ import annotations

import pytest


def test_switch_settings_parse_and_name_unknown_switches():
    from benchmarks.k26_switches import parse_settings

    assert parse_settings("base,skinny+moe_pf") == [("base", frozenset()), ("skinny+moe_pf",
                                                                              frozenset({"skinny", "moe_pf"}))]
    assert parse_settings("default") == [("default", frozenset({"skinny", "moe_early", "skinny_early", "glue_early",
                                                                 "moe_w16"}))]
    with pytest.raises(ValueError, match=r"unknown switch \['turbo'\]"):
        parse_settings("base,skinny+turbo")


def test_skinny_tree_widens_the_token_limit_and_the_defaults_restore_it():
    from benchmarks.k26_switches import DEFAULT_ON, apply
    from runtime.model import layers

    try:
        apply(frozenset({"skinny", "skinny_tree"}))
        assert layers.SKINNY_GEMM and layers.SKINNY_MAX_TOKENS == 24
        assert layers.SKINNY_MAX_WEIGHT_BYTES == layers.SKINNY_LIMITS[1]  # the weight limit stays the default's
        apply(frozenset({"skinny", "skinny_wide", "skinny_tree"}))
        assert layers.SKINNY_MAX_TOKENS == 32  # skinny_tree never narrows skinny_wide's
    finally:
        apply(DEFAULT_ON)
    assert (layers.SKINNY_MAX_TOKENS, layers.SKINNY_MAX_WEIGHT_BYTES) == layers.SKINNY_LIMITS


def test_norm_switches_keep_the_tiny_forward_bits(monkeypatch):
    """norm_gemm / norm_tree / norm_q move launches, never values: the tiny K2.6-layout forward on the CPU (the
    references: the query's norm through ResidualStep and rms_norm, the latent rows through mla_q_absorb_kv) gives
    the bits it gives with them off.  (On the GPU: tests/test_skinny_gemm.py's engine test.)"""
    import torch

    from runtime.bench_rank import load_rank_models
    from runtime.model import attention, layers

    model, _, _, _ = load_rank_models("tiny-kimi", 1, 0, None, 0, torch.device("cpu"), False)
    tokens, positions = torch.tensor([[1, 2, 3]]), torch.tensor([[0, 1, 2]])
    mask = torch.tensor([[[1], [3], [7]]])  # [1, 3, 1]: a chain

    def forward():
        cache = model.new_cache(1, 64, 4)
        hidden, feats = model.forward(tokens, positions, cache, mask)
        return hidden, cache.scratch.clone()

    want = forward()
    for name in ("NORM_GEMM", "NORM_TREE"):
        monkeypatch.setattr(layers, name, True)
    monkeypatch.setattr(attention, "NORM_Q", True)
    got = forward()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
