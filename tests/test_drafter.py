"""The DFlash drafter: z-lab format loading, context caching, batching, config refusals."""

from __future__ import annotations

import json

import pytest
import torch
from decoding import load_pair

from build_pipeline.tiny_drafter import default_target_layer_ids, make_tiny_drafter
from core.drafter_config import load_drafter_config, parse_drafter_config
from core.errors import ConfigError


@pytest.fixture(scope="module")
def pair(tiny, tmp_path_factory):
    target_dir = tiny.get("kimi")
    drafter_dir = tmp_path_factory.mktemp("dr") / "d"
    make_tiny_drafter(target_dir, drafter_dir)
    m = load_pair(target_dir, drafter_dir, dtype=torch.float64)
    return m.target, m.drafter


def test_z_lab_layout(tiny, tmp_path):
    d = make_tiny_drafter(tiny.get("kimi"), tmp_path / "d")
    raw = json.loads((d / "config.json").read_text())
    # z-lab's two keys, plus ours: the fingerprint of the target it was made for (core/fingerprint.py)
    assert raw["architectures"] == ["DFlashDraftModel"] and set(raw["dflash_config"]) == {
        "mask_token_id", "target_layer_ids", "target_fingerprint"}
    header = json.loads((d / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
        (d / "model.safetensors").read_bytes()[:8], "little")])
    names = set(header) - {"__metadata__"}
    assert "fc.weight" in names and "layers.0.self_attn.q_norm.weight" in names
    assert not any(n.startswith("model.") or "embed" in n or "lm_head" in n for n in names)
    assert default_target_layer_ids(61, 6) == [1, 12, 24, 35, 47, 58]


def _feats(target, b, a, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, a, len(target.feature_layers) * target.cfg.hidden_size, generator=g, dtype=torch.float64)


def test_context_given_at_once_or_in_rounds_drafts_the_same(pair):
    target, drafter = pair
    feats = _feats(target, 1, 9, 0)
    bonus = torch.tensor([17])
    whole = drafter.new_cache(1, 32)
    once = drafter.draft(whole, feats, torch.tensor([9], dtype=torch.int32), bonus)
    split = drafter.new_cache(1, 32)
    drafter.draft(split, feats[:, :5], torch.tensor([5], dtype=torch.int32), torch.tensor([3]))
    twice = drafter.draft(split, feats[:, 5:], torch.tensor([4], dtype=torch.int32), bonus)
    assert int(whole.lens[0]) == int(split.lens[0]) == 9
    torch.testing.assert_close(once, twice)
    assert once.shape == (1, drafter.block_size - 1, target.cfg.vocab_size)


def test_batched_requests_with_different_context_lengths(pair):
    target, drafter = pair
    feats = _feats(target, 3, 6, 1)
    lens = torch.tensor([6, 2, 4], dtype=torch.int32)
    bonus = torch.tensor([5, 6, 7])
    batch = drafter.draft(drafter.new_cache(3, 32), feats, lens, bonus)
    for r in range(3):
        one = drafter.draft(drafter.new_cache(1, 32), feats[r:r + 1, : int(lens[r])], lens[r:r + 1], bonus[r:r + 1])
        torch.testing.assert_close(batch[r], one[0])


def test_drafter_config_refusals(tiny, tmp_path):
    d = make_tiny_drafter(tiny.get("kimi"), tmp_path / "d")
    raw = json.loads((d / "config.json").read_text())
    cfg = load_drafter_config(d)
    assert cfg.block_size == 8 and cfg.mask_token_id == 1022
    for key, value, needle in [("is_causal", True, "is_causal"), ("layer_types", ["sliding_attention"], "layer_types"),
                               ("num_key_value_heads", 3, "num_key_value_heads")]:
        bad = dict(raw, **{key: value})
        with pytest.raises(ConfigError, match=needle):
            parse_drafter_config(bad)
    nested = dict(raw, dflash_config=dict(raw["dflash_config"], block_size=4))
    assert parse_drafter_config(nested).block_size == 4  # dflash_config wins over the top level
    bad = dict(raw, dflash_config={"mask_token_id": 5})
    with pytest.raises(ConfigError, match="target_layer_ids"):
        parse_drafter_config(bad)
