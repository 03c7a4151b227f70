"""plugins/skinny_gemm: the op's reference and errors, the plan, a CPU model of skinny_gemm.cu lane by lane (PTX's
m16n8k16 fragments: A register r of lane (g, q) holds row g + 8 (r % 2), logical k 2q + 8 (r // 2) + (0, 1); B
register b holds logical k 2q + 8 b + (0, 1) of token column g; C element i is row g + 8 (i // 2), column
2q + i % 2), the source's compile for sm_90 / sm_120 / sm_80, and on the GPU the kernel against the reference."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from plugins.skinny_gemm import skinny_gemm
from plugins.skinny_gemm.launch import MAX_TOKENS, SOURCE, U_VARIANTS, plan, split_shape, token_tiles

NVCC = shutil.which("nvcc")


def test_reference_is_fp32_accumulation_rounded_once():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 96, generator=g).bfloat16(), torch.randn(40, 96, generator=g).bfloat16()
    c = torch.randn(5, 40, generator=g).bfloat16()
    want = (x.float() @ w.float().t() + c.float()).bfloat16()
    assert torch.equal(skinny_gemm(x, w, c), want)
    assert torch.equal(skinny_gemm(x, w, out_f32=True), x.float() @ w.float().t())
    assert skinny_gemm(x.double(), w.double(), out_f32=True).dtype == torch.float64


def test_errors_name_the_tensor():
    x, w = torch.zeros(2, 32), torch.zeros(8, 32)
    with pytest.raises(ValueError, match=r"x must be \[t, k\] and w \[n, k\]"):
        skinny_gemm(x, torch.zeros(8, 16))
    with pytest.raises(ValueError, match="c must be"):
        skinny_gemm(x, w, torch.zeros(2, 9))
    with pytest.raises(ValueError, match="c must be"):
        skinny_gemm(x, w, torch.zeros(2, 8), out_f32=True)


def test_plan_depends_on_t_only_through_the_token_tiles():
    """W and KS (the sum order) come from (n, k, SMs): t = 1 and t = 17 sum every element in the same order."""
    for n, k in ((2112, 7168), (1536, 1536), (7168, 1024), (896, 7168), (20480, 7168), (40, 64)):
        plans = [plan(t, n, k, False, False, 132) for t in (1, 8, 9, 16, 17, 32)]
        assert len({(p.warps, p.splits) for p in plans}) == 1
        assert [p.kernel.split("_")[3] for p in plans] == ["t1", "t1", "t2", "t2", "t4", "t4"]
    assert split_shape(2112, 7168, 132) == (16, 1)  # qkv_a: a row group per SM, 16 warps over k
    assert split_shape(896, 7168, 132) == (8, 4)  # the router + shared gate_up: 56 groups -> 4 k splits
    assert split_shape(7168, 1024, 132) == (4, 1)  # o_proj: 448 groups, 4 warps each
    assert token_tiles(MAX_TOKENS) == 4


def test_default_prefetch_only_where_k_is_split(monkeypatch):
    """launch.PREFETCH None: the L2 prefetch where the plan splits k (router, q_b), not for one split per group."""
    from plugins.skinny_gemm import launch

    monkeypatch.setattr(launch, "PREFETCH", None)
    assert launch.prefetch_for(plan(1, 896, 7168, True, False, 132))  # router + shared gate_up, KS 4
    assert launch.prefetch_for(plan(1, 1536, 1536, False, False, 132))  # q_b, KS 2
    assert not launch.prefetch_for(plan(1, 2112, 7168, False, False, 132))  # qkv_a, KS 1
    monkeypatch.setattr(launch, "PREFETCH", False)
    assert not launch.prefetch_for(plan(1, 896, 7168, True, False, 132))


def test_layers_send_only_one_token_gemms_of_at_most_the_size_limit(monkeypatch):
    """runtime.model.layers' default: one token and <= SKINNY_MAX_WEIGHT_BYTES of weights go to the kernel (where it
    won), more tokens or the dense MLP's bigger weights stay cuBLAS's (_skinny answers None)."""
    from runtime.model import layers

    seen = []
    monkeypatch.setattr(layers, "skinny_supports", lambda *a: seen.append(a[0].shape) or True)
    monkeypatch.setattr(layers, "skinny_gemm", lambda x, w, c, f32: torch.zeros(x.shape[0], w.shape[0]))
    w_small = torch.empty(2112, 64, dtype=torch.bfloat16)
    assert layers._skinny(torch.ones(1, 64, dtype=torch.bfloat16), w_small, None, torch.bfloat16) is not None
    assert layers._skinny(torch.ones(2, 64, dtype=torch.bfloat16), w_small, None, torch.bfloat16) is None
    w_big = torch.empty(layers.SKINNY_MAX_WEIGHT_BYTES // 2 // 64 + 16, 64, dtype=torch.bfloat16)
    assert layers._skinny(torch.ones(1, 64, dtype=torch.bfloat16), w_big, None, torch.bfloat16) is None
    assert seen == [(1, 64)]


def _kernel_model(x: torch.Tensor, w: torch.Tensor, warps: int, splits: int) -> torch.Tensor:
    """skinny_gemm.cu's arithmetic on the CPU in fp64: per CTA (group, split), warp, block, k step and lane, the
    fragment registers it loads, the mma, the warp-order reduction, the split-order sum -> y [t, n]."""
    t, k = x.shape
    n = w.shape[0]
    tt = token_tiles(t)
    nkb = k // 32
    per = -(-nkb // splits)
    xp = torch.zeros(8 * tt, k, dtype=torch.float64)
    xp[:] = x[0].double()  # token columns past t read token 0
    xp[:t] = x.double()
    y = torch.zeros(t, n, dtype=torch.float64)
    for grp in range(-(-n // 16)):
        r0 = grp * 16
        rows = [min(r0 + r, n - 1) for r in range(16)]  # rows past n read row n - 1
        split_tiles = []
        for s in range(splits):
            lo, hi = min(nkb, s * per), min(nkb, min(nkb, s * per) + per)
            warp_tiles = []
            for wi in range(warps):
                acc = torch.zeros(tt, 16, 8, dtype=torch.float64)  # C [tile, row, token col]
                for kb in range(lo + wi, hi, warps):
                    for st in range(2):
                        a = torch.zeros(16, 16, dtype=torch.float64)  # A [row, logical k]
                        b = torch.zeros(tt, 16, 8, dtype=torch.float64)  # B [tile, logical k, token]
                        for lane in range(32):
                            g, q = lane // 4, lane % 4
                            base = kb * 32 + 8 * q  # the lane's 8 contiguous columns
                            ra, rb = w[rows[g], base:base + 8].double(), w[rows[g + 8], base:base + 8].double()
                            words = [(ra, 2 * st), (rb, 2 * st), (ra, 2 * st + 1), (rb, 2 * st + 1)]  # a0..a3
                            for r, (vec, wd) in enumerate(words):
                                row, col = g + 8 * (r % 2), 2 * q + 8 * (r // 2)
                                a[row, col], a[row, col + 1] = vec[2 * wd], vec[2 * wd + 1]
                            for j in range(tt):
                                xv = xp[8 * j + g, base:base + 8]
                                for bi, wd in enumerate((2 * st, 2 * st + 1)):  # b0, b1
                                    b[j, 2 * q + 8 * bi, g], b[j, 2 * q + 8 * bi + 1, g] = xv[2 * wd], xv[2 * wd + 1]
                        for j in range(tt):
                            acc[j] += a @ b[j]
                warp_tiles.append(acc)
            split_tiles.append(sum(warp_tiles[1:], warp_tiles[0].clone()))
        total = sum(split_tiles[1:], split_tiles[0].clone())
        for tok in range(t):
            for r in range(16):
                if r0 + r < n:
                    y[tok, r0 + r] = total[tok // 8, r, tok % 8]
    return y


@pytest.mark.parametrize("t,n,k,warps,splits", [(1, 16, 64, 1, 1), (3, 40, 128, 2, 1), (9, 24, 256, 2, 2),
                                                 (17, 16, 96, 1, 3), (32, 20, 64, 4, 1)])
def test_kernel_model_is_the_product(t, n, k, warps, splits):
    """The lane model's fragments, permuted k and reductions give x . w^T: the kernel's index algebra is right."""
    g = torch.Generator().manual_seed(t * 100 + n)
    x, w = torch.randn(t, k, generator=g), torch.randn(n, k, generator=g)
    want = x.double() @ w.double().t()
    torch.testing.assert_close(_kernel_model(x, w, warps, splits), want, rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("arch", ["sm_90", "sm_120", "sm_80"])
def test_source_compiles_with_every_planned_kernel(tmp_path, arch):
    ptx = tmp_path / "k.ptx"
    subprocess.run([NVCC, "-O3", "-std=c++17", "-ptx", f"-arch={arch}", "-o", str(ptx), str(SOURCE)], check=True)
    text = ptx.read_text()
    names = {plan(t, 64, 64, f32, c, 132, u=u).kernel for t in (1, 16, 32) for f32, c in ((0, 0), (0, 1), (1, 0))
             for u in U_VARIANTS[token_tiles(t)]}
    assert len(names) == 18
    for name in names:
        assert f".entry {name}(" in text, name
    assert ("cp.async.bulk.prefetch.L2" in text) == (arch != "sm_80")
    assert ("griddepcontrol.wait" in text) == (arch != "sm_80")


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")


@pytest.mark.gpu
@GPU
def test_kernel_matches_the_reference_on_fresh_random_cases():
    """Fresh random shapes (K2.6's among them) and tokens: bf16 and fp32 outputs, c added, every (W, KS) plan, the
    L2 prefetch, all within a bf16 rounding of the fp32-accumulated reference; fp32 outputs within 1e-5."""
    from plugins.skinny_gemm.launch import skinny_gemm_cuda
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(7)
    shapes = [(2112, 7168), (1536, 1536), (7168, 1024), (896, 7168), (40, 64), (8, 32), (130, 2304)]
    shapes += [(int(torch.randint(1, 600, (1,), generator=gen)), 32 * int(torch.randint(1, 120, (1,), generator=gen)))
               for _ in range(20)]
    for i, (n, k) in enumerate(shapes):
        t = int(torch.randint(1, MAX_TOKENS + 1, (1,), generator=gen))
        x = torch.randn(t, k, generator=gen).bfloat16().to(dev)
        w = (torch.randn(n, k, generator=gen) / k ** 0.5).bfloat16().to(dev)
        c = torch.randn(t, n, generator=gen).bfloat16().to(dev)
        ref = x.float() @ w.float().t()
        got = skinny_gemm_cuda(x, w, None, True, pf=bool(i % 2))
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        got = skinny_gemm_cuda(x, w, c, False)
        torch.testing.assert_close(got.float(), (ref + c.float()).bfloat16().float(), rtol=1e-2, atol=1e-2)
        for splits in (1, 2, 3):
            got = skinny_gemm_cuda(x, w, None, False, splits=splits, warps=2)
            torch.testing.assert_close(got.float(), ref.bfloat16().float(), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@GPU
def test_a_token_row_does_not_depend_on_the_batch_and_graphs_replay_it():
    """Row i of a 17-token call is the bits of the 1-token call on that row (AR vs tree rounds), prefetch or not,
    early weights or not, also from a replayed CUDA graph."""
    from plugins.skinny_gemm import launch
    from plugins.skinny_gemm.launch import skinny_gemm_cuda
    dev = torch.device("cuda")
    torch.manual_seed(3)
    for n, k in ((2112, 7168), (896, 7168), (7168, 1024)):
        x = torch.randn(17, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
        many = skinny_gemm_cuda(x, w, None, True)
        for i in (0, 5, 16):
            assert torch.equal(skinny_gemm_cuda(x[i:i + 1], w, None, True, pf=True)[0], many[i])
        launch.EARLY_WEIGHTS = True  # the first weights loaded before the PDL wait: only loads move, the same bits
        try:
            assert torch.equal(skinny_gemm_cuda(x, w, None, True), many)
            assert torch.equal(skinny_gemm_cuda(x[:1], w, None, True)[0], many[0])
        finally:
            launch.EARLY_WEIGHTS = False
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            skinny_gemm_cuda(x, w, None, False)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=s):
                out = skinny_gemm_cuda(x, w, None, False)
        g.replay()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, skinny_gemm_cuda(x, w, None, False))


@pytest.mark.gpu
@GPU
def test_engine_with_the_switch_is_lossless(tiny, tmp_path, monkeypatch):
    """KDTREE_SKINNY_GEMM on (runtime.model.layers.SKINNY_GEMM) for every GEMM the kernel takes (the default takes
    one-token GEMMs only): the tiny INT4 model's GEMMs go through the kernel (counted), graphs on, and DDTree gives
    the AR tokens, since a row's bits do not depend on the token count."""
    from build_pipeline.tiny_drafter import make_tiny_drafter
    from plugins.skinny_gemm import launch
    from runtime.engine.engine import Engine
    from runtime.model import layers

    calls = []
    real = layers.skinny_gemm
    monkeypatch.setattr(layers, "SKINNY_GEMM", True)
    monkeypatch.setattr(layers, "SKINNY_MAX_TOKENS", launch.MAX_TOKENS)
    monkeypatch.setattr(layers, "SKINNY_MAX_WEIGHT_BYTES", launch.MAX_WEIGHT_BYTES)
    monkeypatch.setattr(layers, "skinny_gemm", lambda *a: calls.append(1) or real(*a))
    path, drafter = tiny.get("kimi", int4=True, kimi25=True), tmp_path / "drafter"
    make_tiny_drafter(path, drafter)
    prompt = list(range(3, 40, 3))
    runs = {}
    for spec, budget in (("none", None), ("ddtree", 8)):
        eng = Engine.load(path, device="cuda", drafter=drafter if budget else None, spec=spec, budget=budget)
        runs[spec] = list(eng.generate_ids(prompt, 24))
        assert eng.last_stats["graphs"]
    assert calls, "no GEMM of the tiny model went through skinny_gemm"
    assert runs["ddtree"] == runs["none"]

