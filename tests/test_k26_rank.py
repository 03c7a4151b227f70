"""GPU: a K2.6-width TP8 rank at reduced depth, drawn in GPU memory and written as a synthetic artifact.

- The in-memory draw (runtime/load/synthetic.py, what `kdtree bench kimi-k2.6 --rank-only` runs at full
  depth) holds exactly the tensors `kdtree build --synthetic ... --device cuda` writes and read_rank reads.
- The rank runs end to end alone (SoloRankComm) with graphs: AR, chain and DDTree give the same tokens at
  T = 0 in fp32 (up to the first near-tie of the AR logits, where fp32 rounding may choose either).
- `kdtree bench ART --rank-only` runs on the artifact and reports finite, positive figures.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from build_pipeline.synthetic import build_synthetic
from plugins.common.bitmask import causal_mask
from runtime.engine.engine import Engine
from runtime.load.artifact import read_rank
from runtime.load.synthetic import draw_models, draw_rank
from runtime.model.weights import tensors_of
from runtime.parallel.solo import SoloRankComm

pytestmark = pytest.mark.gpu

TIE = 1e-3  # fp32 logit gap under which two kernels' rounding may choose differently


@pytest.fixture(scope="module")
def k26_art(tmp_path_factory):
    art = tmp_path_factory.mktemp("k26") / "rank0"
    build_synthetic("kimi-k2.6", art, tp=8, rank=0, layers=2, device="cuda", progress=False)
    return art


def test_drawn_rank_equals_artifact(k26_art):
    disk = list(tensors_of(read_rank(k26_art, 0, "cuda", torch.bfloat16).weights))
    mem = list(tensors_of(draw_rank("kimi-k2.6", 8, 0, layers=2, device="cuda").weights))
    assert len(disk) == len(mem) > 20
    for a, b in zip(disk, mem):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def test_k26_width_rank_runs_lossless():
    comm = SoloRankComm(0, 8, torch.device("cuda"))
    target, drafter = draw_models("kimi-k2.6", comm, layers=4, dtype=torch.float32)
    assert drafter.shards == 8 and drafter.heads == 8 and drafter.kv_heads == 1
    rng = random.Random(5)
    prompt = [rng.randrange(target.cfg.vocab_size) for _ in range(40)]
    eng = Engine.from_models(target, drafter, None, spec="none", graphs=True)
    ar = list(eng.generate_ids(prompt, 24))
    assert eng.last_stats["graphs"], eng.last_stats.get("graph_note")
    seq = torch.tensor(prompt + ar, device="cuda")[None]  # [1, L]
    n = seq.shape[1]
    h, _ = target.forward(seq, torch.arange(n, device="cuda")[None], target.new_cache(1, n + 1, n),
                          causal_mask(1, n, "cuda"))
    logits = F.linear(h[0], target.w.lm_head)  # [L, v/8]: alone, the rank's all-gather repeats its slice
    assert torch.isfinite(logits).all()
    top2 = logits.topk(2, dim=-1).values
    gaps = (top2[:, 0] - top2[:, 1]).tolist()[len(prompt) - 1:]
    safe = next((j for j, g in enumerate(gaps) if g < TIE), len(ar))
    assert safe >= 8, f"near-tie at step {safe}: the check would compare too little"
    for spec, budget in (("chain", 16), ("ddtree", 16), ("ddtree", 64)):
        e = eng.configure(spec=spec, budget=budget)
        out = list(e.generate_ids(prompt, 24))
        assert e.last_stats["graphs"]
        assert out[:safe] == ar[:safe], (spec, budget, safe)


def test_one_launch_moe_keeps_the_ar_tokens(monkeypatch):
    """launch_v3.ONE_LAUNCH (the AR step's gate_up and down in one grid, kdtree_moe_v3_one) inside the engine's
    captured AR step of a bf16 K2.6-width rank: the same tokens as the two kernels (the same bits, kernel for
    kernel: tests/test_moe_v3_gpu.py); with the grid forming the shared expert's product too (ONE_SHARED: the same
    values summed in another order, a fixed seed) and the combine too (ONE_COMBINE) the same tokens as well."""
    from plugins.common.device import device_facts
    from plugins.moe_w4a16 import launch_v3
    monkeypatch.setattr(launch_v3, "ONE_LAUNCH", True)
    if not launch_v3.one_launch_applies(1, 8, 16, 224, 224, 8, device_facts("cuda")):
        pytest.skip("kdtree_moe_v3_one runs on an sm_90 GPU of at least 128 SMs")
    target, _ = draw_models("kimi-k2.6", SoloRankComm(0, 8, torch.device("cuda")), layers=3)
    rng = random.Random(7)
    prompt = [rng.randrange(target.cfg.vocab_size) for _ in range(24)]
    outs = {}
    for flags in ((False, False, False), (True, False, False), (True, True, False), (True, True, True)):
        for name, on in zip(("ONE_LAUNCH", "ONE_SHARED", "ONE_COMBINE"), flags):
            monkeypatch.setattr(launch_v3, name, on)
        eng = Engine.from_models(target, None, None, spec="none", graphs=True)
        outs[flags] = list(eng.generate_ids(prompt, 16))
        assert eng.last_stats["graphs"], eng.last_stats.get("graph_note")
    assert all(out == outs[False, False, False] for out in outs.values()), outs


def test_bench_rank_only_on_artifact(k26_art):
    from runtime.bench_rank import format_rank_table, run_rank_bench

    res = run_rank_bench(str(k26_art), contexts=(256,), budgets=(1, 8), iters=2, profile_budget=8, progress=False)
    assert res["tp"] == 8 and res["layers"] == 2 and res["loaded_by"] == "read_rank"
    assert [r["mode"] for r in res["rows"]] == ["ar", "ddtree-1", "ddtree-8"]
    for r in res["rows"]:
        for k in ("step_us", "verify_us", "verify_roofline_us"):
            assert math.isfinite(r[k]) and r[k] > 0, (r["mode"], k)
        assert 1 <= r["experts_touched_per_layer"] <= 384
    assert res["profiles"]["ddtree-8"]["kernels"] > res["profiles"]["ar"]["kernels"] > 0
    assert 0 < res["profiles"]["drafter"]["kernels"] < res["profiles"]["ddtree-8"]["kernels"]  # the drafter alone
    assert "ddtree-8" in format_rank_table(res)


def test_switches_ab_on_artifact(k26_art, tmp_path, monkeypatch):
    """benchmarks/k26_switches.py loads the rank once and times each switch setting (every switch on in the second),
    leaving the defaults set after."""
    import json
    import sys

    import benchmarks.k26_switches as ks
    from plugins.moe_w4a16 import launch_v3
    from plugins.skinny_gemm import launch as skinny_launch
    from runtime.model import layers

    # the MoE's and the GEMMs' weights after the wait, the one-token MoE grid
    every = "skinny+skinny_wide+moe_pf+gemm_pf+attn_pf+moe_w16+moe_one_launch"
    monkeypatch.setattr(sys, "argv", ["k26_switches", "--source", str(k26_art), "--settings", f"base,{every}",
                                      "--context", "256",
                                      "--budget", "8", "--iters", "2", "--profile", "--out", str(tmp_path)])
    ks.main()
    rows = json.loads((tmp_path / "k26-switches.json").read_text())["rows"]
    assert [r["setting"] for r in rows] == ["base", every]
    for r in rows:
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("ar_step_us", "ddtree8_step_us", "ddtree8_drafter_us"))
        assert r["ar_kernels_per_layer"] > 0 and r["ddtree8_classes"]["moe_experts"]["kernels"] > 0  # --profile
    assert layers.SKINNY_GEMM and layers.SKINNY_MAX_TOKENS == 1  # the defaults again
    assert launch_v3.USE_W16 and launch_v3.EARLY_WEIGHTS and skinny_launch.EARLY_WEIGHTS and launch_v3.ONE_LAUNCH
    from plugins.layer_fusion import kernel as fusion_kernel
    assert fusion_kernel.EARLY_WEIGHTS


def test_router_bf16_gate_matches_fp64():
    """The bf16 K2.6 rank routes with the gate as stored (bf16) and an fp32 result (router_logits):
    the same logits as the products summed in fp64, to fp32 rounding, and the same top-8 experts."""
    from runtime.model.moe import router_logits

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(33, 7168, device="cuda", generator=g).bfloat16()  # [t, d]
    gate = (torch.randn(384, 7168, device="cuda", generator=g) * 7168 ** -0.5).bfloat16()  # [e, d]
    got = router_logits(x, gate)  # [t, e]
    ref = F.linear(x.double(), gate.double())
    assert got.dtype == torch.float32
    assert (got.double() - ref).abs().max().item() < 1e-4
    assert torch.equal(got.topk(8).indices.sort().values, ref.topk(8).indices.sort().values)
