"""`kdtree build --synthetic`: one rank of random weights in exactly the layout a real build writes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from build_pipeline import artifact_cache, synthetic
from build_pipeline.build import build
from build_pipeline.synthetic import build_synthetic, preset_config
from core.config import load_config
from core.errors import CheckpointError
from core.safetensors_file import SafetensorsFile
from runtime.decode.prefill import prefill
from runtime.engine.engine import Engine
from runtime.load.artifact import read_rank
from runtime.load.models import load_models
from runtime.model.target import TargetModel


def _stored(art: Path, rank: int) -> dict[str, tuple[str, tuple[int, ...], torch.dtype]]:
    """{tensor name: (file, shape, dtype)} of rank's files."""
    out = {}
    for f in sorted((art / f"rank{rank}").glob("*.safetensors")):
        sf = SafetensorsFile(f)
        out.update({k: (f.name, tuple(sf.tensor(k).shape), sf.tensor(k).dtype) for k in sf.keys()})
        sf.close()
    return out


def _leaves(obj, prefix="") -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of every tensor inside read_rank's nested weight dataclasses."""
    if isinstance(obj, torch.Tensor):
        return {prefix: (tuple(obj.shape), obj.dtype)}
    if isinstance(obj, list):
        return {k: v for i, x in enumerate(obj) for k, v in _leaves(x, f"{prefix}.{i}").items()}
    if dataclasses.is_dataclass(obj):
        return {k: v for f in dataclasses.fields(obj)
                for k, v in _leaves(getattr(obj, f.name), f"{prefix}.{f.name}").items()}
    return {}


def test_rank_matches_a_real_build_of_the_same_config(tiny, tmp_path, monkeypatch):
    """tp 2, rank 1: the same file names, tensor names, shapes and dtypes as build_pipeline/shard.py writes for
    a tiny INT4 kimi_k25 checkpoint of the same config; the same manifest keys; read_rank loads it alike."""
    monkeypatch.setenv("KDTREE_CACHE", str(tmp_path / "kc"))
    ckpt = tiny.get("kimi", int4=True, kimi25=True)
    cfg, _ = preset_config("tiny-kimi")
    assert cfg == load_config(ckpt)
    real = build(ckpt, tp=2, archs="none", progress=False)
    syn = build_synthetic("tiny-kimi", tmp_path / "ART", tp=2, rank=1, progress=False)
    assert not syn.cache_hit and artifact_cache.verify(syn.art_dir) is None
    a, b = _stored(real.art_dir, 1), _stored(syn.art_dir, 1)
    assert sorted(a) == sorted(b)
    for k in a:
        if k.endswith("moe.gate_bias"):  # Kimi ships it fp32 (so do we); make-tiny's transformers casts it to bf16
            assert a[k][:2] == b[k][:2] and b[k][2] == torch.float32, k
        else:
            assert a[k] == b[k], (k, a[k], b[k])
    m_real, m_syn = real.manifest, syn.manifest
    assert set(m_real) <= set(m_syn) and m_syn["options"]["synthetic"] == "tiny-kimi" and "seed" in m_syn["options"]
    assert m_syn["plan"] == {"tp": 2, "ep": False} and list(m_syn["ranks"]) == ["1"]
    assert set(m_syn["ranks"]["1"]) == set(m_real["ranks"]["1"])
    assert [f["path"] for f in m_syn["ranks"]["1"]["files"]] == [f["path"] for f in m_real["ranks"]["1"]["files"]]
    for k in ("vocab_range", "experts", "heads"):
        assert m_syn["ranks"]["1"][k] == m_real["ranks"]["1"][k]
    w_real = _leaves(read_rank(real.art_dir, 1, "cpu", torch.float32).weights)
    w_syn = _leaves(read_rank(syn.art_dir, 1, "cpu", torch.float32).weights)
    assert w_real == w_syn
    from plugins.moe_w4a16.fragment_layout import from_fragments, to_fragments

    f = SafetensorsFile(syn.art_dir / "rank1" / "layer.001.safetensors")
    for w, k in (("w13", cfg.hidden_size), ("w2", cfg.moe_intermediate_size // 2)):  # d = 128 < kp = 256: padded
        packed, scale = f.tensor(f"layers.1.moe.{w}_packed"), f.tensor(f"layers.1.moe.{w}_scale")
        assert packed.dim() == 5  # d and i_l are multiples of 32: fragment order, as the real build writes
        again = to_fragments(*from_fragments(packed, scale, k, w == "w13"), w == "w13")  # exact only with
        assert torch.equal(again[0], packed) and torch.equal(again[1], scale), w          # padding q = 0, scale 0
    with pytest.raises(CheckpointError, match=r"rank 0 is not in this artifact \(it holds ranks \['1'\]\)"):
        read_rank(syn.art_dir, 0, "cpu", torch.float32)  # only rank 1 was made


def test_seeded_bytes_reproducible_and_ranks_consistent(tmp_path):
    """Same seed: identical files; a second command on an intact --out is a no-op; another seed differs;
    replicated tensors are equal across ranks, cut ones are not; layer i does not depend on --layers."""
    one = build_synthetic("tiny-kimi", tmp_path / "a", tp=2, rank=0, layers=2, progress=False)
    two = build_synthetic("tiny-kimi", tmp_path / "b", tp=2, rank=0, layers=2, progress=False)
    assert one.manifest["files"] == two.manifest["files"] and one.manifest["key"] == two.manifest["key"]
    assert build_synthetic("tiny-kimi", tmp_path / "a", tp=2, rank=0, layers=2, progress=False).cache_hit
    other = build_synthetic("tiny-kimi", tmp_path / "c", tp=2, rank=0, layers=2, seed=1, progress=False)
    assert all(other.manifest["files"][p]["sha256"] != h["sha256"] for p, h in one.manifest["files"].items())
    r1 = build_synthetic("tiny-kimi", tmp_path / "r1", tp=2, rank=1, layers=3, progress=False)
    f0 = SafetensorsFile(tmp_path / "a" / "rank0" / "layer.001.safetensors")
    f1 = SafetensorsFile(tmp_path / "r1" / "rank1" / "layer.001.safetensors")
    for name in ("attn.q_a", "attn.kv_a", "moe.gate", "moe.gate_bias", "attn_norm"):
        assert torch.equal(f0.tensor(f"layers.1.{name}"), f1.tensor(f"layers.1.{name}")), name
    for name in ("attn.q_b", "attn.w_uk", "attn.o", "moe.w13_packed", "moe.shared.down"):
        assert not torch.equal(f0.tensor(f"layers.1.{name}"), f1.tensor(f"layers.1.{name}")), name
    assert r1.manifest["files"]["rank1/layer.001.safetensors"]["sha256"] == build_synthetic(
        "tiny-kimi", tmp_path / "r1b", tp=2, rank=1, layers=2, progress=False).manifest["files"][
        "rank1/layer.001.safetensors"]["sha256"]


def test_tp1_rank_decodes_with_finite_logits(tmp_path):
    """A one-rank synthetic artifact loads through load_models and the Engine (no tokenizer: ids only)."""
    art = build_synthetic("tiny-kimi", tmp_path / "ART", tp=1, rank=0, layers=2, progress=False).art_dir
    m = load_models(art, dtype=torch.float32)
    assert m.tokenizer is None and m.drafter is None
    cache = m.target.new_cache(1, 64, 16)
    h, _ = prefill(m.target, cache, torch.tensor([5, 17, 300, 42, 9]))
    logits = m.target.logits(h)
    assert torch.isfinite(logits).all() and logits.std() > 0.1
    eng = Engine.load(art)
    out = list(eng.generate_ids([5, 17, 300, 42, 9], max_new_tokens=4))
    assert 1 <= len(out) <= 4 and all(0 <= t < m.target.cfg.vocab_size for t in out)


def test_residual_stays_bounded_over_61_layers(tmp_path, monkeypatch):
    """The init (residual writers / sqrt(2 L)) at K2.6's depth: tiny widths, 61 layers, fp32 on CPU."""
    deep = synthetic._with_text(synthetic.PRESETS["tiny-kimi"], num_hidden_layers=61)
    monkeypatch.setitem(synthetic.PRESETS, "tiny-kimi-61", deep)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threads only cost (10x on a busy 2-core machine)
    try:
        art = build_synthetic("tiny-kimi-61", tmp_path / "ART", tp=1, rank=0, progress=False).art_dir
        bundle = read_rank(art, 0, "cpu", torch.float32)
        model = TargetModel(bundle.cfg, bundle.weights, feature_layers=(0, 30, 60))
        h, feats = prefill(model, model.new_cache(1, 64, 16), torch.arange(1, 9) * 37)
    finally:
        torch.set_num_threads(threads)
    rms = feats.pow(2).view(8, 3, -1).mean(-1).sqrt()  # [p, 3]: the residual after layers 0, 30, 60
    assert torch.isfinite(rms).all() and rms.max() < 4.0 and rms.min() > 0.5, rms
    assert torch.isfinite(model.logits(h)).all()


def test_cli_rank_outside_plan_is_one_error_line(tmp_path):
    from typer.testing import CliRunner

    from runtime.cli import app

    out = tmp_path / "ART"
    r = CliRunner().invoke(app, ["build", "--synthetic", "kimi-k2.6", "--tp", "8", "--rank", "8", "--out", str(out)])
    assert r.exit_code == 1 and r.stderr.strip() == "error: --rank 8 is outside [0, 8) for --tp 8", r.stderr
    assert not out.exists()
    r = CliRunner().invoke(app, ["build", "--synthetic", "tiny-kimi", "--tp", "2", "--rank", "1", "--layers", "2",
                                 "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["artifact"] == str(out) and s["ranks"] == {"1": 3} and s["plan"]["tp"] == 2
