"""moe_wgmma.cu (moe_w4a16's expert GEMMs on wgmma, launch_wgmma.py) on the GPU, taken at every t here
(launch_wgmma.FORCE), against the fp32 reference on the exactly dequantised experts: 200 random routing / size / EP
cases whose shapes the kernels take, with routing drawn plain or hot (a few experts get most tokens: entries of 1 to
64 slots and experts over several 64-slot tiles), plus the K2.6 TP8 rank at 64 to 1024 tokens; fresh random data
each (never zeros), a caller's workspace poisoned on odd seeds.  Each case: y within the reference's tolerance
(||y - ref|| / ||ref|| < 2e-2, as tests/test_moe_v3_gpu.py), close to v3's mma.sync kernels on the same call (they
round the group scales differently: moe_wgmma.cu's header), two calls equal bit for bit, other tokens through the
same workspace right after within tolerance, the routing counts back at zero, and a CUDA graph of the op replayed on
new tokens.  Writes $KDTREE_RESULTS_DIR/moe_wgmma-device-test.json."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
from gpu_cases import gpu_cases
from test_moe_v3_gpu import random_fragments
from test_moe_w4a16 import _poison_allocator, replays_on_new_tokens

from plugins.common.device import device_facts
from plugins.moe_w4a16 import MoEWorkspace, experts_reference, launch_wgmma, moe_w4a16, route_reference
from plugins.moe_w4a16.fragment_layout import dequantize_fragments

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _hopper_only():
    if not torch.cuda.is_available() or device_facts(torch.device("cuda")).arch != "sm_90":
        pytest.skip("moe_wgmma.cu needs sm_90 (wgmma)")


def _forced(on: bool, fn):
    was = launch_wgmma.FORCE
    launch_wgmma.FORCE = on
    try:
        return fn()
    finally:
        launch_wgmma.FORCE = was


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm().clamp_min(1e-20)).item()


def _case(t, e, d, i, k, e_start, e_local, hot, seed, dev) -> dict:
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(t, d, device=dev, generator=g).to(torch.bfloat16)
    logits = torch.randn(t, e, device=dev, generator=g) * 2
    bias = torch.randn(e, device=dev, generator=g) * 0.1
    if hot:  # a few experts take most tokens: entries of up to 64 slots, experts over several tiles
        bias[torch.randperm(e, device=dev, generator=g)[:k + 2]] += 4.0
    (w13, s13), (w2, s2) = random_fragments(e_local, 2 * i, d, dev, g), random_fragments(e_local, d, i, dev, g)
    assert launch_wgmma.shapes_fit(w13.shape[1], w13.shape[2], w2.shape[1], w2.shape[2])
    _poison_allocator(dev, 4 * t * k * (d + i) + 4 * t * d + (1 << 20))
    ws = carved = None
    if seed % 2:  # odd seeds: a caller's workspace for a few more tokens, poisoned but for the zero counts
        carved = MoEWorkspace.allocate(t + 3, k, e_local, d, i, x.dtype, dev)
        carved.buffer.fill_(0xFF)
        carved.counts.zero_()
        carved.sync.zero_()
        ws = carved.buffer
    call = lambda tokens=x: moe_w4a16(tokens, logits, None, bias, w13, s13, w2, s2, k, 1, 1, True, 2.5,  # noqa: E731
                                      e_start, ws)
    y = _forced(True, call)
    same = bool(torch.equal(y, _forced(True, call)))
    y_v3 = _forced(False, call)
    idx, tw = route_reference(logits, bias, k, 1, 1, True, 2.5)
    w13f, w2f = dequantize_fragments(w13, s13, d, True), dequantize_fragments(w2, s2, i, False)
    ref = experts_reference(x.float(), idx, tw, w13f, w2f, e_start)
    x_b = torch.randn(t, d, device=dev, generator=g).to(torch.bfloat16)
    y_b = _forced(True, lambda: call(x_b))
    ref_b = experts_reference(x_b.float(), idx, tw, w13f, w2f, e_start)
    local = idx[(idx >= e_start) & (idx < e_start + e_local)]
    counts = torch.bincount(local.flatten() - e_start, minlength=e_local) if local.numel() else torch.zeros(1)
    return {"t": t, "e": e, "d": d, "i": i, "k": k, "e_start": e_start, "e_local": e_local, "hot": hot, "seed": seed,
            "max_count": int(counts.max()), "rel": _rel(y, ref), "v3_rel": _rel(y_v3, ref),
            "wg_v3_rel": _rel(y, y_v3.float()), "next_call_rel": _rel(y_b, ref_b), "deterministic": same,
            "finite": bool(torch.isfinite(y).all()),
            "counts_rezeroed": carved is None or not carved.counts.any().item()}


def _random_shapes(n: int, seed: int = 0) -> list[tuple]:
    rng = random.Random(seed)
    out = []
    for s in range(n):
        e = rng.choice([16, 64, 384])
        k = rng.choice([2, 8])
        e_local = rng.choice([e, e, max(1, e // 8)])
        out.append((rng.choice([1, 5, 16, 40, 64, 100, 300, 700]), e, rng.choice([128, 256, 512, 1024, 2048]),
                    rng.choice([64, 128, 256, 512]), k, rng.randrange(0, e - e_local + 1), e_local,
                    rng.random() < 0.5, 5000 + s))
    return out


K26 = [(t, 384, 7168, 256, 8, 0, 384, hot, 9000 + t) for t in (64, 129, 257, 512, 1024) for hot in (False, True)]


def test_wgmma_matches_reference_on_random_and_k26_shapes():
    dev = torch.device("cuda")
    n = gpu_cases(200)
    results = [_case(*c, dev=dev) | {"big": j >= n} for j, c in enumerate([*_random_shapes(n), *K26])]
    bad = [r for r in results if not (r["finite"] and max(r["rel"], r["next_call_rel"]) < 2e-2 and r["wg_v3_rel"] < 1e-2
                                      and r["deterministic"] and r["counts_rezeroed"])]
    summary = {"op": "moe_w4a16 wgmma", "checked": len(results), "failed": len(bad),
               "tolerance_rel": 2e-2,
               "max_rel": max(r["rel"] for r in results), "max_wg_v3_rel": max(r["wg_v3_rel"] for r in results),
               "max_count": max(r["max_count"] for r in results), "failures": bad[:20], "cases": results}
    out_dir = os.environ.get("KDTREE_RESULTS_DIR")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "moe_wgmma-device-test.json").write_text(json.dumps(summary, indent=1))
    print(f"moe_w4a16 wgmma GPU: {len(results)} cases, {len(bad)} failed, "
          f"max rel {summary['max_rel']:.2e}, "
          f"max wgmma-v3 rel {summary['max_wg_v3_rel']:.2e}, max slots an expert {summary['max_count']}")
    assert not bad, bad[:5]


def test_wgmma_is_graph_capturable():
    dev = torch.device("cuda")
    t, e, d, i, k = 200, 64, 1024, 256, 8
    g = torch.Generator(device=dev).manual_seed(3)
    x = torch.randn(t, d, device=dev, generator=g).to(torch.bfloat16)
    logits, bias = torch.randn(t, e, device=dev, generator=g), torch.zeros(e, device=dev)
    experts = (*random_fragments(e, 2 * i, d, dev, g), *random_fragments(e, d, i, dev, g))
    ws = MoEWorkspace.allocate(t, k, e, d, i, x.dtype, dev)
    call = lambda: moe_w4a16(x, logits, None, bias, *experts, k, 1, 1, True, 1.0, 0, ws.buffer)  # noqa: E731
    assert _forced(True, lambda: replays_on_new_tokens(call, x, g))
