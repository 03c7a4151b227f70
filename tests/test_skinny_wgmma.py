"""skinny_wgmma.cu (y = x . w^T for t <= 32 tokens on wgmma, sm_90a) against the fp32 reference.

CPU (nvcc, cuobjdump; no GPU): the source compiles for sm_90a with one wgmma shape a token width and no spills; the
launcher's shared memory is the source's layout; the plan.  GPU (`-m gpu`): 200 fresh random cases (t 1..32, n
multiple of 64 or not, k a multiple of 64, 1..16 k splits or the plan's, bf16 or fp32 out, with and without c, PDL
on and off, the K2.6 TP8 shapes) against x . w^T (+ c) in fp32: fp32 out within 1e-5 relative, bf16 out within the
output's rounding (2^-8 relative a element); the same bits twice (the split sums in split order, whichever CTA comes
last) and with either split count equal to the reference within the tolerance; a CUDA graph replaying new tokens; a
row's bits the same whatever the token count.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from gpu_cases import gpu_cases

from plugins.skinny_gemm import wgmma_launch

NVCC = shutil.which("nvcc")
K26 = [(2112, 7168), (1536, 1536), (7168, 1024), (896, 7168), (7168, 256)]  # qkv_a, q_b, o_proj, router, shared down


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
def test_source_compiles_for_sm90a_with_wgmma_and_no_spills(tmp_path):
    from test_pdl_order_sass import _cuobjdump
    cubin = tmp_path / "k.cubin"
    res = subprocess.run([NVCC, "-O3", "-std=c++17", "-cubin", "-arch=sm_90a", "-Xptxas", "-v", "-o", str(cubin),
                          str(wgmma_launch.SOURCE)], capture_output=True, text=True, check=True)
    # 8 kernels (NT 8..32, bf16 / fp32 out) for each of one and four boxes a stage
    assert res.stderr.count("0 bytes spill stores") == 16 and "bytes stack frame" in res.stderr, res.stderr
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found")
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    for nt in (8, 16, 24, 32):  # bf16 and fp32 out: 4 k steps of 16 a 64-column box (the k loop unrolled by ptxas)
        found = sass.count(f"HGMMA.64x{nt}x16.F32.BF16")
        assert found and found % 8 == 0, (nt, found)


def test_launcher_constants_are_the_sources():
    defines = dict(re.findall(r"#define (\w+) (\d+)\b", wgmma_launch.SOURCE.read_text()))
    assert int(defines["BM"]) == wgmma_launch.BLOCK_M and int(defines["BK"]) == wgmma_launch.BLOCK_K
    assert int(defines["THREADS"]) == wgmma_launch.THREADS
    variants = re.findall(r"SKINNY_WGMMA_KERNEL\(kdtree_skinny_wgmma(_kb\d)?_t##NT##_##NAME, NT, OUT_F32, "
                          r"(\d+), (\d+)\)", wgmma_launch.SOURCE.read_text())
    assert {int(kb): int(st) for _, kb, st in variants} == wgmma_launch.STAGES, variants
    assert all(wgmma_launch.smem_bytes(32, kb) <= 227 * 1024 for kb in wgmma_launch.STAGES)


def test_plan():
    p = wgmma_launch.plan(17, 2112, 7168, False, 132)  # qkv_a: 33 row blocks x 4 splits
    assert (p.nt, p.splits, p.grid, p.kernel) == (24, 4, (33, 4), "kdtree_skinny_wgmma_t24_bf16")
    assert wgmma_launch.plan(1, 7168, 1024, False, 132).splits == 1  # o_proj: 112 row blocks
    assert wgmma_launch.plan(32, 896, 7168, True, 132).kernel == "kdtree_skinny_wgmma_t32_f32"
    assert wgmma_launch.plan(9, 7168, 256, False, 132).splits == 1  # 4 k tiles
    with pytest.raises(ValueError, match="k % 64"):
        wgmma_launch.plan(1, 64, 100, False, 132)
    with pytest.raises(ValueError, match="splits must be"):
        wgmma_launch.plan(1, 64, 128, False, 132, splits=3)
    p4 = wgmma_launch.plan(17, 2112, 7168, False, 132, boxes=4)  # 28 stages of 256 columns
    assert (p4.splits, p4.kernel, p4.boxes) == (4, "kdtree_skinny_wgmma_kb4_t24_bf16", 4)
    assert wgmma_launch.plan(9, 64, 320, False, 132, boxes=4).splits == 2  # 5 boxes: stages of 4 and 1
    with pytest.raises(ValueError, match="splits must be"):
        wgmma_launch.plan(1, 64, 512, False, 132, splits=3, boxes=4)


def _reference(x, w, c, out_f32):
    y = x.float() @ w.float().t()
    return y if c is None else y + c.float()


def _errors(y, ref, out_f32) -> dict:
    rel = float((y.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
    return {"rel": rel, "finite": bool(torch.isfinite(y).all()), "tol": 1e-5 if out_f32 else 4e-3}


@pytest.mark.gpu
def test_gpu_random_cases():
    if not wgmma_launch.available(torch.device("cuda")):
        pytest.skip("skinny_wgmma does not load here (not sm_90)")
    gen = torch.Generator().manual_seed(2028)
    rows, failures = [], []
    shapes = [(int(torch.randint(1, 33, (1,), generator=gen)), n, k) for n, k in K26]
    for i in range(gpu_cases(200)):
        if i < len(shapes):
            t, n, k = shapes[i]
        else:
            t = int(torch.randint(1, 33, (1,), generator=gen))
            n = int(torch.randint(1, 64, (1,), generator=gen)) * (64 if i % 3 else 1) + (0 if i % 2 else 7)
            k = 64 * int(torch.randint(1, 80, (1,), generator=gen))
        out_f32, with_c = bool(i % 4 == 1), bool(i % 3 == 2)
        with_c = with_c and not out_f32
        g = torch.Generator(device="cuda").manual_seed(i)
        x = torch.randn(t, k, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(torch.bfloat16)
        c = torch.randn(t, n, device="cuda", generator=g).to(torch.bfloat16) if with_c else None
        boxes = 4 if i % 7 >= 4 else 1  # four 64-column boxes a stage in 3 of 7 cases (a short last stage too)
        stages = -(-(k // 64) // boxes)
        splits = None if i % 2 else int(torch.randint(1, min(stages, 16) + 1, (1,), generator=gen))
        pdl = bool(i % 5)
        y = wgmma_launch.skinny_wgmma(x, w, c, out_f32, splits=splits, pdl=pdl, boxes=boxes)
        y2 = wgmma_launch.skinny_wgmma(x, w, c, out_f32, splits=splits, pdl=pdl, boxes=boxes)
        torch.cuda.synchronize()
        e = _errors(y, _reference(x, w, c, out_f32), out_f32)
        ok = e["finite"] and e["rel"] <= e["tol"] and bool(torch.equal(y, y2))
        row = {"t": t, "n": n, "k": k, "out_f32": out_f32, "c": with_c, "splits": splits, "pdl": pdl,
               "boxes": boxes} | e | \
            {"deterministic": bool(torch.equal(y, y2)), "pass": ok}
        rows.append(row)
        if not ok:
            failures.append(row)
    out_dir = os.environ.get("KDTREE_RESULTS_DIR")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        doc = {"op": "skinny_wgmma", "device": torch.cuda.get_device_name(), "cases": len(rows),
               "failures": len(failures), "max_rel": max(r["rel"] for r in rows), "rows": rows}
        (Path(out_dir) / "skinny_wgmma-device-test.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"skinny_wgmma: {len(rows)} cases, {len(failures)} failures, max rel {max(r['rel'] for r in rows):.3g}")
    assert not failures, failures[:5]


@pytest.mark.gpu
def test_gpu_graph_replays_new_tokens():
    if not wgmma_launch.available(torch.device("cuda")):
        pytest.skip("skinny_wgmma does not load here (not sm_90)")
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(17, 7168, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(2112, 7168, device="cuda", generator=g) * 0.01).to(torch.bfloat16)
    wgmma_launch.skinny_wgmma(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = wgmma_launch.skinny_wgmma(x, w)
    x.copy_(torch.randn(17, 7168, device="cuda", generator=g).to(torch.bfloat16))
    y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    e = _errors(y, _reference(x, w, None, False), False)
    assert e["finite"] and e["rel"] <= e["tol"], e


@pytest.mark.gpu
def test_gpu_a_rows_bits_do_not_depend_on_the_token_count():
    """A row's bits do not depend on the token count: y [t, n] of the first t of 32 tokens is the first t rows of
    y [32, n], for t = 1..32 on the K2.6 shapes, bf16 and fp32 out, one and four boxes a stage.  plan() takes the k
    splits (KS) from n, k, the SMs and the boxes only, never from t, so every output sums the same k splits in the
    same split order at every t; t changes only NT (t rounded up to 8), the wgmma's width, whose token columns are
    summed apart."""
    if not wgmma_launch.available(torch.device("cuda")):
        pytest.skip("skinny_wgmma does not load here (not sm_90)")
    for n, k in K26:
        g = torch.Generator(device="cuda").manual_seed(n + k)
        x = torch.randn(32, k, device="cuda", generator=g).to(torch.bfloat16)  # [32, k]
        w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(torch.bfloat16)  # [n, k]
        for out_f32 in (False, True):
            for boxes in (1, 4):
                y32 = wgmma_launch.skinny_wgmma(x, w, None, out_f32, boxes=boxes)  # [32, n]
                for t in range(1, 33):
                    y = wgmma_launch.skinny_wgmma(x[:t].contiguous(), w, None, out_f32, boxes=boxes)
                    assert torch.equal(y, y32[:t]), (n, k, out_f32, boxes, t)
