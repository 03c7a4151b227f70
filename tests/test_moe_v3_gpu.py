"""moe_w4a16 v3 (fragment-order experts, CUDA C GEMMs) on the GPU against the fp32 reference on the exactly
dequantised experts: 200 random routing / size / EP cases plus K2.6 TP8 and EP8 ranks, fresh random data
each (never zeros), the op's internal buffers poisoned; deterministic (two calls equal bit for bit); a next call
on other tokens through the same workspace matches its own reference; graph capturable.  Tolerance as
tests/test_moe_w4a16.py: ||y - ref|| / ||ref|| < 2e-2.  Writes $KDTREE_RESULTS_DIR/moe_w4a16_v3-device-test.json."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
from gpu_cases import gpu_cases
from test_moe_w4a16 import _poison_allocator

from plugins.layer_fusion import silu_mul
from plugins.moe_w4a16 import (
    MoEWorkspace,
    experts_reference,
    moe_w4a16,
    route_reference,
)
from plugins.moe_w4a16.fragment_layout import dequantize_fragments
from plugins.moe_w4a16 import launch_v3, route_kernel
from plugins.moe_w4a16.launch_v3 import PREFETCH_ENV
from plugins.moe_w4a16.layout import padded_k

pytestmark = pytest.mark.gpu


def random_fragments(e: int, n: int, k: int, dev, g) -> tuple[torch.Tensor, torch.Tensor]:
    """Random experts directly in fragment order (every int32 word is valid) + bf16 scales; padding groups
    (k..kp) hold q = 0 (nibble 8) and scale 0, as to_fragments writes them."""
    c, cr = padded_k(k) // 32, k // 32
    w = torch.randint(-2**31, 2**31 - 1, (e, n // 32, c, 32, 4), device=dev, dtype=torch.int32, generator=g)
    w[:, :, cr:] = 0x88888888 - 2**32
    s = (torch.rand(e, n // 32, c, 8, 4, device=dev, generator=g) * 0.01 + 0.002).to(torch.bfloat16)
    s[:, :, cr:] = 0
    return w, s


def _flipped(switch: str, fn, module=launch_v3):
    """fn() with the boolean module.<switch> (launch_v3's by default) the other way round, restored after."""
    was = getattr(module, switch)
    setattr(module, switch, not was)
    try:
        return fn()
    finally:
        setattr(module, switch, was)


def _case(t, e, d, i, k, n_group, topk_group, e_start, e_local, seed, dev) -> dict:
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(t, d, device=dev, generator=g).to(torch.bfloat16)
    # the router's columns of a wider fp32 GEMM output; every third case the shared expert's gate | up follow and
    # the routing kernel forms its activation (runtime/model/moe.py)
    shared = seed % 3 == 0
    both = torch.randn(t, e + 2 * i, device=dev, generator=g) * 2
    logits, gate_up = both[:, :e], (both[:, e:] if shared else None)
    h = torch.empty(t, i, device=dev, dtype=torch.bfloat16) if shared else None
    bias = torch.randn(e, device=dev, generator=g) * 0.1
    (w13, s13), (w2, s2) = random_fragments(e_local, 2 * i, d, dev, g), random_fragments(e_local, d, i, dev, g)
    _poison_allocator(dev, 4 * t * k * (d + i) + 4 * t * d + (1 << 20))
    ws = carved = None
    if seed % 2:  # odd seeds: a caller's workspace for a few more tokens, poisoned
        carved = MoEWorkspace.allocate(t + 3, k, e_local, d, i, x.dtype, dev)
        carved.buffer.fill_(0xFF)
        carved.counts.zero_()  # poisoned but for the routing counts and the sync words, which the op keeps zero
        carved.sync.zero_()
        ws = carved.buffer

    def call(tokens=x):  # h: the shared expert's activation the routing kernel writes
        return torch.ops.kdtree.moe_w4a16(tokens, logits, None, bias, w13, s13, w2, s2, k, n_group, topk_group, True,
                                          2.5, e_start, ws, gate_up, h)

    os.environ[PREFETCH_ENV] = "0"  # the kernels' L2 prefetch of the expert weights off, then on: a hint, the same bits
    try:
        y = call()
        same = bool(torch.equal(y, call()))
        os.environ[PREFETCH_ENV] = "1"
        same_prefetched = bool(torch.equal(y, call()))
    finally:
        os.environ.pop(PREFETCH_ENV)
    # down's weights prefetched before its PDL wait or not: the same bits
    same_early = bool(torch.equal(y, _flipped("EARLY_WEIGHTS", call)))
    # one token's routing by stores instead of atomics (route_kernel.ONE_TOKEN_STORES) or not: the same bits
    same_route_stores = bool(torch.equal(y, _flipped("ONE_TOKEN_STORES", call, route_kernel)))
    # the 16-warp gate_up's one-token rows without the lists (launch_v3.ONE_TOKEN) or not: the same bits
    same_one = bool(torch.equal(y, _flipped("ONE_TOKEN", call)))
    # gate_up and down in one launch at t = 1 (launch_v3.ONE_LAUNCH, where one_launch_applies) or not: the same bits
    same_one_launch = bool(torch.equal(y, _flipped("ONE_LAUNCH", call)))
    # ... and the combine in that grid (launch_v3.ONE_COMBINE) or not: the same bits
    same_one_combine = bool(torch.equal(y, _flipped("ONE_COMBINE", call)))
    y_w = _flipped("USE_W16", call)  # the other gate_up where the 16-warp one applies (t = 1 at K2.6): 8 or 16 warps
    idx, tw = route_reference(logits, bias, k, n_group, topk_group, True, 2.5)
    w13f, w2f = dequantize_fragments(w13, s13, d, True), dequantize_fragments(w2, s2, i, False)
    ref = experts_reference(x.float(), idx, tw, w13f, w2f, e_start)
    rel = ((y.float() - ref).norm() / ref.norm().clamp_min(1e-20)).item()
    rel_w = ((y_w.float() - ref).norm() / ref.norm().clamp_min(1e-20)).item()
    # other tokens through the same workspace right after: a kernel reading its predecessor's output before that
    # is complete would find the previous call's (down's h before 2026-12-06: tests/test_pdl_order_sass.py)
    x_b = torch.randn(t, d, device=dev, generator=g).to(torch.bfloat16)
    y_b = call(tokens=x_b)
    ref_b = experts_reference(x_b.float(), idx, tw, w13f, w2f, e_start)
    rel_b = ((y_b.float() - ref_b).norm() / ref_b.norm().clamp_min(1e-20)).item()
    down_rel = 0.0
    if shared:  # the combine kernel adding the shared expert's down projection [d, i] (runtime/model/moe.py)
        down = (torch.randn(d, i, device=dev, generator=g) * 0.05).to(torch.bfloat16)
        h2 = torch.empty_like(h)
        y2 = torch.ops.kdtree.moe_w4a16(x, logits, None, bias, w13, s13, w2, s2, k, n_group, topk_group, True, 2.5,
                                        e_start, ws, gate_up, h2, down)
        want = y.float() + h.float() @ down.float().t()  # the routed output as returned, plus the fp32 product
        down_rel = ((y2.float() - want).norm() / want.norm().clamp_min(1e-20)).item()
        # ONE_LAUNCH flipped: at t = 1 the one-token grid forms the product where it applies (ONE_SHARED)
        y2 = _flipped("ONE_LAUNCH", lambda: torch.ops.kdtree.moe_w4a16(
            x, logits, None, bias, w13, s13, w2, s2, k, n_group, topk_group, True, 2.5, e_start, ws, gate_up, h2, down))
        down_rel = max(down_rel, ((y2.float() - want).norm() / want.norm().clamp_min(1e-20)).item())
    return {"t": t, "e": e, "d": d, "i": i, "k": k, "n_group": n_group, "topk_group": topk_group,
            "e_start": e_start, "e_local": e_local, "seed": seed, "rel": rel, "other_gate_up_rel": rel_w,
            "next_call_rel": rel_b,
            "deterministic": same,
            "prefetch_equal": same_prefetched, "early_equal": same_early,
            "route_stores_equal": same_route_stores, "one_token_equal": same_one,
            "one_launch_equal": same_one_launch, "one_combine_equal": same_one_combine,
            "shared_down_rel": down_rel,
            "finite": bool(torch.isfinite(y).all()),
            "counts_rezeroed": carved is None or not (carved.counts.any() or carved.sync.any()).item(),
            # layer_fusion's silu_mul kernel bit for bit (the same Triton function, plugins/common/activation_kernel)
            "shared_equal": not shared or bool(torch.equal(h, silu_mul(gate_up, torch.bfloat16)))}


def _random_shapes(n: int, seed: int = 0) -> list[tuple]:
    rng = random.Random(seed)
    out = []
    for s in range(n):
        e = rng.choice([16, 64, 384])
        n_group = rng.choice([1, 1, 4])
        k = rng.choice([2, 8] if e // n_group >= 8 else [2])
        topk_group = n_group if n_group == 1 else rng.choice([2, 4])
        e_local = rng.choice([e, e, max(1, e // 8)])
        e_start = rng.randrange(0, e - e_local + 1)
        out.append((rng.choice([1, 2, 5, 8, 13, 16, 40, 100, 300]), e, rng.choice([64, 96, 256, 320, 512, 1024]),
                    rng.choice([32, 64, 96, 256]), k, n_group, topk_group, e_start, e_local, 3000 + s))
    return out


BIG = [  # K2.6 TP8 rank (384 x 256 x 7168, top-8), EP8 rank (48 whole experts of 2048)
    *[(t, 384, 7168, 256, 8, 1, 1, 0, 384, 7000 + t) for t in (1, 3, 8, 16, 17, 33, 64, 257, 512)],
    *[(t, 384, 7168, 2048, 8, 1, 1, 48 * r, 48, 8000 + t) for t, r in ((1, 0), (16, 3), (64, 7))],
]


def test_v3_matches_reference_on_random_and_k26_shapes():
    dev = torch.device("cuda")
    results = []
    n = gpu_cases(200)
    for j, c in enumerate([*_random_shapes(n), *BIG]):
        results.append(_case(*c, dev=dev) | {"big": j >= n})
    bad = [r for r in results if not (r["finite"] and max(r["rel"], r["other_gate_up_rel"], r["next_call_rel"]) < 2e-2
                                      and r["deterministic"] and r["counts_rezeroed"]
                                      and r["shared_equal"] and r["prefetch_equal"] and r["early_equal"]
                                      and r["route_stores_equal"] and r["one_token_equal"] and r["one_launch_equal"]
                                      and r["one_combine_equal"]
                                      and r["shared_down_rel"] < 1e-2)]
    summary = {"op": "moe_w4a16 v3", "checked": len(results), "failed": len(bad), "tolerance_rel": 2e-2,
               "max_rel": max(r["rel"] for r in results), "failures": bad[:20], "cases": results}
    out_dir = os.environ.get("KDTREE_RESULTS_DIR")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "moe_w4a16_v3-device-test.json").write_text(json.dumps(summary, indent=1))
    print(f"moe_w4a16 v3 GPU: {len(results)} shapes, {len(bad)} failed, max rel {summary['max_rel']:.2e}")
    assert not bad, bad[:5]


def _inputs(t: int, e: int, d: int, i: int, seed: int):
    """x [t, d] bf16, logits [t, e], zero bias and fragment-order experts (w13, s13, w2, s2), fresh random."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(t, d, device=dev, generator=g).to(torch.bfloat16)
    logits = torch.randn(t, e, device=dev, generator=g)
    experts = (*random_fragments(e, 2 * i, d, dev, g), *random_fragments(e, d, i, dev, g))
    return g, x, logits, torch.zeros(e, device=dev), experts


def test_v3_is_graph_capturable():
    t, e, d, i, k = 16, 64, 512, 256, 8
    g, x, logits, bias, experts = _inputs(t, e, d, i, 1)
    ws = MoEWorkspace.allocate(t, k, e, d, i, x.dtype, x.device)
    call = lambda: moe_w4a16(x, logits, None, bias, *experts, k, 1, 1, True, 1.0, 0, ws.buffer)  # noqa: E731
    eager = call()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = call()
    x.copy_(torch.randn(t, d, device=x.device, generator=g).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, call()) and not torch.equal(out, eager)


def test_v3_equals_v2c_on_the_same_experts():
    """The same experts in both layouts: v3 and the Triton v2c path agree to bf16 rounding."""
    from plugins.moe_w4a16 import planar_copy
    t, e, d, i, k = 16, 384, 7168, 256, 8
    _, x, logits, bias, experts = _inputs(t, e, d, i, 2)
    y3 = moe_w4a16(x, logits, None, bias, *experts, k, 1, 1, True, 2.5, 0)
    y2 = moe_w4a16(x, logits, None, bias, *planar_copy(*experts, d), k, 1, 1, True, 2.5, 0)
    rel = ((y3.float() - y2.float()).norm() / y2.float().norm()).item()
    assert rel < 1e-2, rel


# (e, d, i, top_k, e_start, e_local): shapes kdtree_moe_v3_one takes at t = 1 on a 132-SM GPU (k groups a multiple of
# 16 x 7, down's row pairs within 16 a CTA): the K2.6 TP8 rank, an EP slice of it (picks outside the rank's experts
# skip both GEMMs), and smaller ones with padded i (i = 128: half the down groups padding)
ONE_SHAPES = [(384, 7168, 256, 8, 0, 384), (384, 7168, 256, 8, 96, 48), (64, 3584, 128, 8, 0, 64),
              (64, 3584, 256, 2, 0, 64), (16, 3584, 128, 2, 4, 8)]


@pytest.mark.parametrize("shape", ONE_SHAPES)
def test_one_launch_equals_the_two_kernels(shape, monkeypatch):
    """launch_v3.ONE_LAUNCH: at t = 1 gate_up and down in one grid (per-pick counters between them) give the bits of
    the 16-warp gate_up and down kernels, on fresh random tokens, logits and bias, three seeds each, through a
    workspace poisoned but for the counts and sync words, which the call leaves zero; in a CUDA graph replayed on
    new tokens as well."""
    e, d, i, k, e_start, e_local = shape
    dev = torch.device("cuda")
    w13, s13, w2, s2, ws = _one_launch_experts(shape, e + d, i, monkeypatch)
    for seed in range(3):
        g = torch.Generator(device=dev).manual_seed(100 * seed + e_local)
        x = torch.randn(1, d, device=dev, generator=g).to(torch.bfloat16)
        logits, bias = torch.randn(1, e, device=dev, generator=g) * 2, torch.randn(e, device=dev, generator=g) * 0.1
        call = lambda: moe_w4a16(x, logits, None, bias, w13, s13, w2, s2, k, 1, 1, True, 2.5, e_start,  # noqa: E731
                                 ws.buffer)
        one = call()
        assert torch.equal(one, call()) and not (ws.counts.any() or ws.sync.any())
        monkeypatch.setattr(launch_v3, "ONE_LAUNCH", False)
        two = call()
        monkeypatch.setattr(launch_v3, "ONE_LAUNCH", True)
        assert torch.equal(one, two), (shape, seed)
        monkeypatch.setattr(launch_v3, "ONE_COMBINE", True)  # the combine in the grid too: the same bits
        assert torch.equal(one, call()) and not (ws.counts.any() or ws.sync.any()), (shape, seed)
        monkeypatch.setattr(launch_v3, "ONE_COMBINE", False)
        idx, tw = route_reference(logits, bias, k, 1, 1, True, 2.5)
        ref = experts_reference(x.float(), idx, tw, dequantize_fragments(w13, s13, d, True),
                                dequantize_fragments(w2, s2, i, False), e_start)
        assert ((one.float() - ref).norm() / ref.norm().clamp_min(1e-20)).item() < 2e-2
    _replays_equal(call, ws, x)
    monkeypatch.setattr(launch_v3, "ONE_COMBINE", True)
    _replays_equal(call, ws, x)


def _one_launch_experts(shape: tuple, seed13: int, seed2: int, monkeypatch) -> tuple:
    """(w13, s13, w2, s2, workspace) for a one-launch test of ONE_SHAPES' shape: fresh random fragment-order experts
    (generators seeded seed13 / seed2), ONE_LAUNCH on (the test skips where kdtree_moe_v3_one does not apply), and a
    workspace poisoned but for the counts and sync words, which the op keeps zero."""
    from plugins.common.device import device_facts
    e, d, i, k, e_start, e_local = shape
    dev = torch.device("cuda")
    (w13, s13), (w2, s2) = (random_fragments(e_local, 2 * i, d, dev, torch.Generator(device=dev).manual_seed(seed13)),
                            random_fragments(e_local, d, i, dev, torch.Generator(device=dev).manual_seed(seed2)))
    monkeypatch.setattr(launch_v3, "ONE_LAUNCH", True)
    if not launch_v3.one_launch_applies(1, k, w13.shape[1], w13.shape[2], w2.shape[1], w2.shape[2],
                                        device_facts(dev)):
        pytest.skip("kdtree_moe_v3_one runs on an sm_90 GPU of at least top_k x w13's row pairs SMs")
    ws = MoEWorkspace.allocate(1, k, e_local, d, i, torch.bfloat16, dev)
    ws.buffer.fill_(0xFF)
    ws.counts.zero_()
    ws.sync.zero_()
    return w13, s13, w2, s2, ws


def _replays_equal(call, ws: MoEWorkspace, *inputs: torch.Tensor) -> None:
    """call() captured in a CUDA graph, replayed twice on new random inputs (bf16 ones redrawn in bf16): each replay
    equals an eager call's bits and leaves the sync words zero."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = call()
    for _ in range(2):
        for a in inputs:
            a.copy_((torch.randn(a.shape, device=a.device) * 2).to(a.dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, call()) and not ws.sync.any()


@pytest.mark.parametrize("shape", ONE_SHAPES)
def test_one_launch_forms_the_shared_experts_product(shape, monkeypatch):
    """launch_v3.ONE_SHARED: the one-token grid also forms the shared expert's down product (fp32, into the
    workspace's shared_f) and the combine adds it.  Off, the grid with the shared expert gives the two kernels' bits;
    on, shared_f is the fp32 product of the routing kernel's h and the weights (or, where the rows' weights would
    not fit in shared memory, the combine forms it: the two kernels' bits), y is within bf16 rounding of the
    two kernels' and of the reference; three seeds, fresh random data, a poisoned workspace, a graph replayed on new
    tokens.  (The combine's own product sums in another order: the same value, not the same bits.)  With ONE_COMBINE
    the grid also sums the rows into y: the combine kernel's bits, the counts and tickets zeroed."""
    e, d, i, k, e_start, e_local = shape
    i_s = 2 * i if i < 256 else i  # the shared expert's columns on the rank (K2.6 TP8: 256)
    dev = torch.device("cuda")
    w13, s13, w2, s2, ws = _one_launch_experts(shape, d, i + 1, monkeypatch)
    for seed in range(3):
        g = torch.Generator(device=dev).manual_seed(200 * seed + e_local)
        x = torch.randn(1, d, device=dev, generator=g).to(torch.bfloat16)
        both = torch.randn(1, e + 2 * i_s, device=dev, generator=g) * 2  # router logits | shared gate | up
        logits, gate_up = both[:, :e], both[:, e:]
        bias = torch.randn(e, device=dev, generator=g) * 0.1
        down = (torch.randn(d, i_s, device=dev, generator=g) * 0.05).to(torch.bfloat16)  # [d, i'] shared down
        h = torch.empty(1, i_s, device=dev, dtype=torch.bfloat16)
        call = lambda: moe_w4a16(x, logits, None, bias, w13, s13, w2, s2, k, 1, 1, True, 2.5, e_start,  # noqa: E731
                                 ws.buffer, gate_up, h, down)
        monkeypatch.setattr(launch_v3, "ONE_SHARED", False)
        plain = call()
        monkeypatch.setattr(launch_v3, "ONE_LAUNCH", False)
        two = call()
        monkeypatch.setattr(launch_v3, "ONE_LAUNCH", True)
        assert torch.equal(plain, two), (shape, seed)
        monkeypatch.setattr(launch_v3, "ONE_SHARED", True)
        ws.shared_f.fill_(float("nan"))
        one = call()
        assert torch.equal(one, call()) and not (ws.counts.any() or ws.sync.any())
        product = h.float() @ down.float().t()  # [1, d] the fp32 product
        if launch_v3.one_shared_rows(k, w13.shape[1], w2.shape[1], w2.shape[2], x, h, down) == 0:  # past smem
            assert torch.equal(one, two), (shape, seed)  # the combine forms the product itself
        else:
            assert ((ws.shared_f - product[0]).norm() / product.norm()).item() < 1e-5, (shape, seed)
        monkeypatch.setattr(launch_v3, "ONE_COMBINE", True)  # the combine in the grid too: the same bits
        assert torch.equal(one, call()) and not (ws.counts.any() or ws.sync.any()), (shape, seed)
        monkeypatch.setattr(launch_v3, "ONE_COMBINE", False)
        assert ((one.float() - two.float()).norm() / two.float().norm()).item() < 1e-2, (shape, seed)
        idx, tw = route_reference(logits, bias, k, 1, 1, True, 2.5)
        ref = experts_reference(x.float(), idx, tw, dequantize_fragments(w13, s13, d, True),
                                dequantize_fragments(w2, s2, i, False), e_start) + product
        assert ((one.float() - ref).norm() / ref.norm().clamp_min(1e-20)).item() < 2e-2, (shape, seed)
    _replays_equal(call, ws, x, gate_up)  # new tokens and shared gate | up
    monkeypatch.setattr(launch_v3, "ONE_COMBINE", True)
    _replays_equal(call, ws, x, gate_up)
