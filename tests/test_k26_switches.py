"""benchmarks/k26_switches.py's settings (the GPU run is tests/test_k26_rank.py::test_switches_ab_on_artifact)."""

from __future__ import annotations

import pytest


def test_switch_settings_parse_and_name_unknown_switches():
    from benchmarks.k26_switches import parse_settings

    assert parse_settings("base,skinny+moe_pf") == [("base", frozenset()), ("skinny+moe_pf",
                                                                              frozenset({"skinny", "moe_pf"}))]
    assert parse_settings("default") == [("default", frozenset({"skinny", "moe_early", "skinny_early", "glue_early",
                                                                 "moe_w16", "attn_long", "attn_wgmma", "skinny_wgmma",
                                                                 "route_stores", "absorb_tree", "attn_early",
                                                                 "attn_wgmma_ar", "attn_early2",
                                                                 "attn_wgmma_wide", "moe_one", "moe_one_shared",
                                                                 "moe_one_launch"}))]
    with pytest.raises(ValueError, match=r"unknown switch \['turbo'\]"):
        parse_settings("base,skinny+turbo")
    (name, parts), = parse_settings("default+moe_pf")  # a named set joins switches as one
    assert name == "default+moe_pf" and parts == parse_settings("default")[0][1] | {"moe_pf"}


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


def test_wgmma_t1_takes_one_token_and_the_defaults_restore_it():
    from benchmarks.k26_switches import DEFAULT_ON, apply
    from runtime.model import layers

    default = layers.WGMMA_TOKENS
    try:
        apply(DEFAULT_ON | {"wgmma_t1"})
        assert layers.WGMMA_TOKENS == (1, default[1])
    finally:
        apply(DEFAULT_ON)
    assert layers.WGMMA_TOKENS == default == (2, 32)


def test_default_on_is_the_modules_defaults():
    """DEFAULT_ON names exactly the flag switches whose module attribute is on when nothing was set."""
    import importlib

    from benchmarks.k26_switches import _FLAGS, DEFAULT_ON
    for name, (module, attr) in _FLAGS.items():
        assert bool(getattr(importlib.import_module(module), attr)) == (name in DEFAULT_ON), name


def test_the_attention_switches_set_their_flags_and_the_defaults_restore_them():
    """attn_early2 / attn_wgmma_wide (on by default) set wgmma_launch.EARLY2 and launcher.WGMMA_WIDE; apply(DEFAULT_ON)
    puts back the module defaults."""
    from benchmarks.k26_switches import DEFAULT_ON, apply
    from plugins.tree_verify_mla import launcher, wgmma_launch

    try:
        apply(DEFAULT_ON - {"attn_early2", "attn_wgmma_wide"})
        assert wgmma_launch.EARLY and not wgmma_launch.EARLY2 and launcher.WGMMA_AR and not launcher.WGMMA_WIDE
    finally:
        apply(DEFAULT_ON)
    assert wgmma_launch.EARLY and wgmma_launch.EARLY2 and launcher.WGMMA_AR and launcher.WGMMA_WIDE
