"""plugins/skinny_gemm: the op's reference and errors, the plan, a CPU model of skinny_gemm.cu lane by lane (PTX's
m16n8k16 fragments: A register r of lane (g, q) holds row g + 8 (r % 2), logical k 2q + 8 (r // 2) + (0, 1); B
register b holds logical k 2q + 8 b + (0, 1) of token column g; C element i is row g + 8 (i // 2), column
2q + i % 2) with one or two row groups per CTA and 1-4 token tiles, the source's compile for sm_90 / sm_120 / sm_80
(every planned kernel, no spill on sm_90), and on the GPU the kernel against the reference."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch

from plugins.skinny_gemm import skinny_gemm
from plugins.skinny_gemm.launch import (MAX_TOKENS, SOURCE, U_VARIANTS, plan, row_groups_per_cta, split_shape,
                                        token_tiles)

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
        plans = [plan(t, n, k, False, False, 132) for t in (1, 8, 9, 16, 17, 24, 25, 32)]
        assert len({(p.warps, p.splits) for p in plans}) == 1
        assert [p.kernel.split("_")[3] for p in plans] == ["t1", "t1", "t2", "t2", "t3", "t3", "t4", "t4"]
    assert split_shape(2112, 7168, 132) == (16, 1)  # qkv_a: a row group per SM, 16 warps over k
    assert split_shape(896, 7168, 132) == (8, 4)  # the router + shared gate_up: 56 groups -> 4 k splits
    assert split_shape(7168, 1024, 132) == (4, 1)  # o_proj: 448 groups, 4 warps each
    assert token_tiles(MAX_TOKENS) == 4


def test_row_groups_per_cta_change_neither_warps_nor_splits(monkeypatch):
    """RG (one or two 16-row groups per CTA) moves rows between CTAs, never W or KS (KS's rule counts 16-row
    groups); the default pairs groups for t > 8 where the paired CTAs still cover the SMs, and the switch turns it
    off."""
    from plugins.skinny_gemm import launch

    for n, k in ((2112, 7168), (1536, 1536), (7168, 1024), (896, 7168), (7168, 256), (4608, 7168), (40, 64)):
        w_ks = split_shape(n, k, 132)
        for t in (9, 16, 17, 24, 32):
            pair, single = plan(t, n, k, True, False, 132, row_groups=2), plan(t, n, k, True, False, 132, row_groups=1)
            assert (pair.warps, pair.splits) == (single.warps, single.splits) == w_ks
            assert pair.grid == (-(-single.grid[0] // 2), single.splits) and "_r2_" in pair.kernel
            assert pair.smem == (pair.warps * 2 * token_tiles(t) * 128 + 1) * 4
    # K2.6 TP8 on 132 SMs: o_proj's 448 groups pair (224 CTAs), qkv_a's 132 and the router's 56 x 4 would not
    assert [plan(t, 7168, 1024, False, False, 132).row_groups for t in (1, 8, 9, 16, 17, 32)] == [1, 1, 2, 2, 2, 2]
    assert plan(16, 7168, 1024, False, False, 132).kernel == "kdtree_skinny_gemm_t2_r2_u4_bf16"
    assert row_groups_per_cta(16, 2112, 7168, 132) == row_groups_per_cta(16, 896, 7168, 132) == 1
    with pytest.raises(ValueError, match="no variant of 2 row groups"):
        plan(1, 7168, 1024, False, False, 132, row_groups=2)
    monkeypatch.setattr(launch, "ROW_GROUP_PAIRS", False)
    assert plan(16, 7168, 1024, False, False, 132).kernel == "kdtree_skinny_gemm_t2_u6_bf16"


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


def _frag_index(tok: int, row: int) -> int:
    """skinny_gemm.cu's frag_index: output (token, row of a 16-row group) -> its place in [TT][4][32] fragments."""
    col = tok & 7
    i = (2 if row >= 8 else 0) + (col & 1)
    lane = ((row & 7) << 2) | (col >> 1)
    return ((tok >> 3) * 4 + i) * 32 + lane


def _mma(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc [16, 8] += a [16, 16] . b [16, 8], each output column from its own B column in a fixed k order (the
    hardware's order is another, but fixed too: what matters here is that a column sees nothing else)."""
    for kk in range(16):
        acc += a[:, kk:kk + 1] * b[kk:kk + 1, :]


def _kernel_model(x: torch.Tensor, w: torch.Tensor, warps: int, splits: int, row_groups: int = 1,
                  dtype: torch.dtype = torch.float64, frag: bool = False) -> torch.Tensor:
    """skinny_gemm.cu's arithmetic on the CPU in `dtype`: per CTA (column, split), warp, block, k step, row group
    and lane, the fragment registers it loads (the token columns once for all row groups), the mma, the C fragments
    stored to shared memory as [W][RG][TT][4][32], the warp-order reduction, the split partials as [column][KS]
    [RG x TT x 128] and their split-order sum, read back through frag_index -> y [t, n].  frag: the _frag kernels'
    loads, at their addresses in the fragment-order weight (16-byte word rg * nkb * 64 + lane + 64 kb, and 32 on)."""
    t, k = x.shape
    n = w.shape[0]
    tt, rg = token_tiles(t), row_groups
    nkb = k // 32
    per = -(-nkb // splits)
    cta_rows, tile = 16 * rg, rg * tt * 128
    cols = -(-(-(-n // 16)) // rg)
    xp = torch.zeros(8 * tt, k, dtype=dtype)
    xp[:] = x[0].to(dtype)  # token columns past t read token 0
    xp[:t] = x.to(dtype)
    wd = w.to(dtype)
    if frag:  # [16-byte words, 8]: what the kernel's uint4 pointers index
        from plugins.skinny_gemm.fragment_order import to_fragment_order
        words16 = to_fragment_order(w).to(dtype).reshape(-1, 8)
    parts = torch.zeros(cols * splits * tile, dtype=dtype)
    y = torch.zeros(t, n, dtype=dtype)
    for cta in range(cols):
        r0 = cta * cta_rows
        rows_n = min(cta_rows, n - r0)
        for s in range(splits):
            lo = min(nkb, s * per)
            hi = min(nkb, lo + per)
            red = torch.zeros(warps * tile, dtype=dtype)  # shared memory
            for wi in range(warps):
                acc = torch.zeros(rg, tt, 16, 8, dtype=dtype)  # C [row group, tile, row, token col]
                for kb in range(lo + wi, hi, warps):
                    for st in range(2):
                        b = torch.zeros(tt, 16, 8, dtype=dtype)  # B [tile, logical k, token]: xv, loaded once
                        for lane in range(32):
                            g, q = lane // 4, lane % 4
                            base = kb * 32 + 8 * q  # the lane's 8 contiguous columns
                            for j in range(tt):
                                xv = xp[8 * j + g, base:base + 8]
                                for bi, wrd in enumerate((2 * st, 2 * st + 1)):  # b0, b1
                                    b[j, 2 * q + 8 * bi, g], b[j, 2 * q + 8 * bi + 1, g] = xv[2 * wrd], xv[2 * wrd + 1]
                        for h in range(rg):
                            rows = [min(r0 + 16 * h + r, n - 1) for r in range(16)]  # rows past n read row n - 1
                            a = torch.zeros(16, 16, dtype=dtype)  # A [row, logical k] of row group h
                            for lane in range(32):
                                g, q = lane // 4, lane % 4
                                base = kb * 32 + 8 * q
                                if frag:  # the CTA's row group h, the last one for a second group past it
                                    gi = min(cta * rg + h, -(-n // 16) - 1)
                                    ia = gi * nkb * 64 + lane + 64 * kb
                                    ra, rb = words16[ia], words16[ia + 32]
                                else:
                                    ra, rb = wd[rows[g], base:base + 8], wd[rows[g + 8], base:base + 8]
                                words = [(ra, 2 * st), (rb, 2 * st), (ra, 2 * st + 1), (rb, 2 * st + 1)]  # a0..a3
                                for r, (vec, wrd) in enumerate(words):
                                    row, col = g + 8 * (r % 2), 2 * q + 8 * (r // 2)
                                    a[row, col], a[row, col + 1] = vec[2 * wrd], vec[2 * wrd + 1]
                            for j in range(tt):
                                _mma(acc[h, j], a, b[j])
                for h in range(rg):  # C register i of lane (g, q): row g + 8 (i // 2), token column 2 q + i % 2
                    for j in range(tt):
                        for i in range(4):
                            for lane in range(32):
                                g, q = lane // 4, lane % 4
                                red[(((wi * rg + h) * tt + j) * 4 + i) * 32 + lane] = acc[h, j, g + 8 * (i // 2),
                                                                                       2 * q + i % 2]
            if splits > 1:  # this split's tile: its warps summed in warp order
                tot = torch.zeros(tile, dtype=dtype)
                for v in range(warps):
                    tot = tot + red[v * tile:(v + 1) * tile]
                parts[(cta * splits + s) * tile:(cta * splits + s + 1) * tile] = tot
        for e in range(tile):  # the last CTA of the column (for KS = 1 the only one, with its shared memory)
            tok, row = e // cta_rows, e % cta_rows
            if tok >= t or row >= rows_n:
                continue
            f = (row >> 4) * tt * 128 + _frag_index(tok, row & 15)
            tot = torch.zeros((), dtype=dtype)
            if splits > 1:
                for v in range(splits):
                    tot = tot + parts[(cta * splits + v) * tile + f]
            else:
                for v in range(warps):
                    tot = tot + red[v * tile + f]
            y[tok, r0 + row] = tot
    return y


@pytest.mark.parametrize("t,n,k,warps,splits,rg", [
    (1, 16, 64, 1, 1, 1), (3, 40, 128, 2, 1, 1), (9, 24, 256, 2, 2, 1), (17, 16, 96, 1, 3, 1), (32, 20, 64, 4, 1, 1),
    (19, 40, 128, 2, 1, 1),  # three tiles
    (9, 40, 128, 2, 2, 2), (16, 72, 64, 1, 1, 2), (17, 16, 96, 1, 3, 2), (24, 33, 128, 2, 2, 2), (32, 20, 64, 4, 1, 2),
])
def test_kernel_model_is_the_product(t, n, k, warps, splits, rg):
    """The lane model's fragments, permuted k and reductions give x . w^T, one or two row groups per CTA (rows past
    n among them), 1-4 token tiles: the kernel's index algebra is right."""
    g = torch.Generator().manual_seed(t * 100 + n)
    x, w = torch.randn(t, k, generator=g), torch.randn(n, k, generator=g)
    want = x.double() @ w.double().t()
    torch.testing.assert_close(_kernel_model(x, w, warps, splits, rg), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("warps,splits", [(2, 1), (1, 3), (2, 2)])
def test_kernel_model_sums_a_row_the_same_whatever_the_row_groups_and_tokens(warps, splits):
    """In fp32 (where the order shows) row i of 17 tokens, one or two row groups per CTA, is the bits of the
    one-token call: the same blocks per warp, warp order and split order, whatever RG and TT."""
    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(17, 192, generator=g), torch.randn(40, 192, generator=g)
    many = {rg: _kernel_model(x, w, warps, splits, rg, torch.float32) for rg in (1, 2)}
    assert torch.equal(many[1], many[2])
    nine = _kernel_model(x[:9], w, warps, splits, 2, torch.float32)
    for i in (0, 5, 8, 16):
        one = _kernel_model(x[i:i + 1], w, warps, splits, 1, torch.float32)
        assert torch.equal(one[0], many[2][i])
        if i < 9:
            assert torch.equal(nine[i], many[2][i])


@pytest.mark.parametrize("n,k", [(16, 32), (40, 96), (2112, 7168), (7, 64)])
def test_fragment_order_is_each_lanes_row_major_load_and_round_trips(n, k):
    """fragment_order: wf[rg, kb, half, 4 g + q] holds the 16 bytes lane (g, q) of the row-major kernel loads from row
    16 rg + 8 half + g at columns 32 kb + 8 q .. + 8 (rows past n zero), and from_fragment_order inverts it exactly."""
    from plugins.skinny_gemm.fragment_order import from_fragment_order, to_fragment_order
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    wf = to_fragment_order(w)
    groups = -(-n // 16)
    assert tuple(wf.shape) == (groups, k // 32, 2, 32, 8) and wf.is_contiguous()
    padded = torch.cat([w, w.new_zeros(groups * 16 - n, k)])
    for rg in {0, groups - 1}:
        for kb in {0, k // 32 - 1}:
            for half in (0, 1):
                for lane in (0, 5, 31):
                    gg, q = lane >> 2, lane & 3
                    want = padded[16 * rg + 8 * half + gg, 32 * kb + 8 * q:32 * kb + 8 * q + 8]
                    assert torch.equal(wf[rg, kb, half, lane], want)
    assert torch.equal(from_fragment_order(wf, n), w)
    with pytest.raises(ValueError, match="k % 32"):
        to_fragment_order(torch.zeros(4, 48))
    with pytest.raises(ValueError, match="holding"):
        from_fragment_order(wf, groups * 16 + 1)


def test_fragment_copy_is_made_once_per_weight_and_dropped_with_it():
    """fragment_order.fragment_copy: one copy per live weight (the same tensor on every ask), made again when the
    weight is written, gone from the table when the weight is freed."""
    import gc

    from plugins.skinny_gemm import fragment_order
    w = torch.randn(40, 64).bfloat16()
    first = fragment_order.fragment_copy(w)
    assert first is fragment_order.fragment_copy(w)
    assert torch.equal(fragment_order.from_fragment_order(first, 40), w)
    w.mul_(2)  # a new version: a new copy of the new values
    second = fragment_order.fragment_copy(w)
    assert second is not first and torch.equal(fragment_order.from_fragment_order(second, 40), w)
    key = id(w)
    del w
    gc.collect()
    assert key not in fragment_order._COPIES


@pytest.mark.parametrize("t,n,k,warps,splits", [(1, 16, 64, 1, 1), (3, 40, 128, 2, 1), (8, 24, 256, 2, 2),
                                                 (5, 33, 96, 1, 3)])
def test_kernel_model_reads_the_same_values_from_fragment_order(t, n, k, warps, splits):
    """The lane model with the _frag kernels' addresses in the fragment-order weight gives the row-major model's bits
    (fp32, where the order shows): the kernel's index algebra for the layout is right, rows past n included."""
    g = torch.Generator().manual_seed(t * 31 + n)
    x, w = torch.randn(t, k, generator=g), torch.randn(n, k, generator=g)
    assert torch.equal(_kernel_model(x, w, warps, splits, 1, torch.float32, frag=True),
                       _kernel_model(x, w, warps, splits, 1, torch.float32))


FRAG_KERNELS = {f"kdtree_skinny_gemm_t1_u8_{out}_frag" for out in ("bf16", "bf16_c", "f32")}


def _planned_kernels() -> set[str]:
    """Every kernel a plan names: token counts of each tile count, both row-group counts, each U, each output."""
    return {plan(t, 64, 64, f32, c, 132, u=u, row_groups=rg).kernel for t in (1, 16, 17, 32) for rg in (1, 2)
            if (token_tiles(t), rg) in U_VARIANTS for f32, c in ((0, 0), (0, 1), (1, 0))
            for u in U_VARIANTS[token_tiles(t), rg]}


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("arch", ["sm_90", "sm_120", "sm_80"])
def test_source_compiles_with_every_planned_kernel(tmp_path, arch):
    ptx = tmp_path / "k.ptx"
    subprocess.run([NVCC, "-O3", "-std=c++17", "-ptx", f"-arch={arch}", "-o", str(ptx), str(SOURCE)], check=True)
    text = ptx.read_text()
    names = _planned_kernels()
    assert len(names) == 42
    for name in names | FRAG_KERNELS:  # and the fragment-order variants (fragment_order.py)
        assert f".entry {name}(" in text, name
    assert ("cp.async.bulk.prefetch.L2" in text) == (arch != "sm_80")
    assert ("griddepcontrol.wait" in text) == (arch != "sm_80")


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("arch", ["sm_90", "sm_120"])
def test_planned_kernels_fit_the_registers(tmp_path, arch):
    """ptxas builds every planned kernel within __launch_bounds__(512)'s 128 registers; on sm_90 (the H100 / H200
    the U choice is made for) without a spill.  sm_120's ptxas allocates otherwise and spills a few words of the
    deepest rings (t4_u4, t3_u5, t2_r2_u4, t3_r2_u3: 20-132 bytes): compiled, not asserted."""
    out = subprocess.run([NVCC, "-O3", "-std=c++17", "-cubin", f"-arch={arch}", "-Xptxas", "-v", "-o",
                          str(tmp_path / "k.cubin"), str(SOURCE)], check=True, capture_output=True, text=True)
    # per kernel: "Compiling entry function 'NAME' for 'ARCH'", then its stack / spill line, then its registers
    found = re.findall(r"Compiling entry function '(\w+)'.*?(\d+) bytes spill stores, (\d+) bytes spill loads"
                       r".*?Used (\d+) registers", out.stdout + out.stderr, re.S)
    stats = {name: (int(stores), int(loads), int(regs)) for name, stores, loads, regs in found}
    for name in _planned_kernels() | FRAG_KERNELS:
        stores, loads, regs = stats[name]
        assert regs <= 128, (name, regs)
        if arch == "sm_90":
            assert stores == loads == 0, (name, stores, loads)


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")


@pytest.mark.gpu
@GPU
def test_kernel_matches_the_reference_on_fresh_random_cases():
    """Fresh random shapes (K2.6's among them) and tokens: bf16 and fp32 outputs, c added, every (W, KS) plan, one
    or two row groups per CTA (t > 8), the L2 prefetch, all within a bf16 rounding of the fp32-accumulated
    reference; fp32 outputs within 1e-5; RG = 2 the bits of RG = 1."""
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
            got = skinny_gemm_cuda(x, w, None, False, splits=splits, warps=2, row_groups=1)
            torch.testing.assert_close(got.float(), ref.bfloat16().float(), rtol=1e-2, atol=1e-2)
            if t > 8:  # two row groups per CTA (rows past n in the last CTA when the groups are odd)
                pair = skinny_gemm_cuda(x, w, None, False, splits=splits, warps=2, row_groups=2, pf=bool(i % 2))
                assert torch.equal(pair, got), (n, k, t, splits)
        if t > 8:
            assert torch.equal(skinny_gemm_cuda(x, w, c, False, row_groups=2), skinny_gemm_cuda(x, w, c, False,
                                                                                               row_groups=1))


@pytest.mark.gpu
@GPU
def test_fragment_order_kernel_gives_the_row_major_kernels_bits():
    """The _frag kernels (weights in fragment order, 512 contiguous bytes a warp load) on fresh random shapes (K2.6's
    one-token GEMMs among them, odd row groups, k split) and 1-8 tokens: bf16 / fp32 out, c added, the L2 prefetch
    on and off, a replayed CUDA graph: the bits of skinny_gemm_cuda on the row-major weight."""
    from plugins.skinny_gemm.fragment_order import to_fragment_order
    from plugins.skinny_gemm.launch import skinny_gemm_cuda, skinny_gemm_frag_cuda
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(17)
    shapes = [(2112, 7168), (1536, 1536), (7168, 1024), (896, 7168), (40, 64), (8, 32)]
    shapes += [(int(torch.randint(1, 600, (1,), generator=gen)), 32 * int(torch.randint(1, 120, (1,), generator=gen)))
               for _ in range(12)]
    for i, (n, k) in enumerate(shapes):
        t = int(torch.randint(1, 9, (1,), generator=gen))
        x = torch.randn(t, k, generator=gen).bfloat16().to(dev)
        w = (torch.randn(n, k, generator=gen) / k ** 0.5).bfloat16().to(dev)
        c = torch.randn(t, n, generator=gen).bfloat16().to(dev)
        wf = to_fragment_order(w)
        for f32, cc in ((True, None), (False, None), (False, c)):
            want = skinny_gemm_cuda(x, w, cc, f32)
            assert torch.equal(skinny_gemm_frag_cuda(x, wf, n, cc, f32, pf=bool(i % 2)), want), (n, k, t, f32)
    n, k = 2112, 7168
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
    wf = to_fragment_order(w)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        skinny_gemm_frag_cuda(x, wf, n, None, False)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            out = skinny_gemm_frag_cuda(x, wf, n, None, False)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, skinny_gemm_cuda(x, w, None, False))
    with pytest.raises(ValueError, match="one token tile"):
        skinny_gemm_frag_cuda(torch.randn(9, k, device=dev, dtype=torch.bfloat16), wf, n, None, False)


@pytest.mark.gpu
@GPU
def test_a_token_row_does_not_depend_on_the_batch_and_graphs_replay_it():
    """Row i of a 17-token call (three token tiles; one or two row groups per CTA) is the bits of the 1-token call
    on that row (AR vs tree rounds), as are the rows of 9 and 32 tokens with two row groups, prefetch or not, early
    weights or not, also from a replayed CUDA graph.  qkv_a with two row groups forced: W = 16, 48 KB + 4 B of
    shared memory (the attribute above 48 KB)."""
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
        for rg in (1, 2):
            assert torch.equal(skinny_gemm_cuda(x, w, None, True, row_groups=rg), many)
            assert torch.equal(skinny_gemm_cuda(x[:9], w, None, True, row_groups=rg), many[:9])
        x32 = torch.cat([x, x[:15]])  # [32, k]: four tiles, rows 17.. repeat rows 0..
        assert torch.equal(skinny_gemm_cuda(x32, w, None, True, row_groups=2)[:17], many)
        early = launch.EARLY_WEIGHTS
        launch.EARLY_WEIGHTS = not early  # the first weights loaded before the PDL wait or after: the same bits
        try:
            assert torch.equal(skinny_gemm_cuda(x, w, None, True), many)
            assert torch.equal(skinny_gemm_cuda(x, w, None, True, row_groups=2), many)
            assert torch.equal(skinny_gemm_cuda(x[:1], w, None, True)[0], many[0])
        finally:
            launch.EARLY_WEIGHTS = early
        launch.LATE_TRIGGER = True  # only the next kernel's launch moves
        try:
            assert torch.equal(skinny_gemm_cuda(x, w, None, True, row_groups=2), many)
        finally:
            launch.LATE_TRIGGER = False
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
    """KDTREE_SKINNY_GEMM for every GEMM the kernel takes (up to launch.MAX_TOKENS tokens; the default takes
    one-token GEMMs only), skinny_wgmma off: the tiny INT4 model's GEMMs go through the kernel (counted), graphs on,
    and DDTree gives the AR tokens exactly, since a row's bits do not depend on the token count.  With skinny_wgmma on
    (the default) the one-token GEMMs and the 2..32-token ones run different kernels, whose bits differ, so there
    DDTree matches AR up to near-ties only (tests/test_k26_rank.py checks that)."""
    from build_pipeline.tiny_drafter import make_tiny_drafter
    from plugins.skinny_gemm import launch
    from runtime.engine.engine import Engine
    from runtime.model import layers

    calls = []
    real = layers.skinny_gemm
    monkeypatch.setattr(layers, "SKINNY_WGMMA", False)
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


@pytest.mark.gpu
@GPU
def test_engine_reads_fragment_order_weights_with_the_same_tokens(tiny, monkeypatch):
    """runtime.model.layers.FRAG_WEIGHTS: the tiny INT4 model's one-token GEMMs on fragment-order copies (counted),
    graphs on: the AR tokens of the row-major kernel, bit for bit (the same loads' values, the same sums)."""
    from runtime.engine.engine import Engine
    from runtime.model import layers

    calls = []
    real = layers.skinny_gemm_frag_cuda
    monkeypatch.setattr(layers, "skinny_gemm_frag_cuda", lambda *a: calls.append(1) or real(*a))
    path = tiny.get("kimi", int4=True, kimi25=True)
    prompt = list(range(3, 40, 3))
    runs = {}
    for frag in (False, True):
        monkeypatch.setattr(layers, "FRAG_WEIGHTS", frag)
        eng = Engine.load(path, device="cuda", spec="none")
        runs[frag] = list(eng.generate_ids(prompt, 24))
        assert eng.last_stats["graphs"]
    assert calls, "no GEMM of the tiny model read a fragment-order weight"
    assert runs[True] == runs[False]
