"""benchmarks/k26_switches.py's settings (the GPU run is tests/test_k26_rank.py::test_switches_ab_on_artifact)."""

from __future__ import annotations

import pytest


def test_switch_settings_parse_and_name_unknown_switches():
    from benchmarks.k26_switches import parse_settings

    assert parse_settings("base,skinny+moe_pf") == [("base", frozenset()), ("skinny+moe_pf",
                                                                              frozenset({"skinny", "moe_pf"}))]
    assert parse_settings("default") == [("default", frozenset({"skinny", "moe_w16"}))]
    with pytest.raises(ValueError, match=r"unknown switch \['turbo'\]"):
        parse_settings("base,skinny+turbo")
