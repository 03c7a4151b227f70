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
