"""tree_verify_wgmma.cu (the wgmma split kernel of tree_verify_mla, sm_90a) against the reference.

CPU (nvcc, cuobjdump; no GPU): the source compiles for sm_90a with the wgmma it is written for and no spills, the
shared memory the launcher asks for is the source's, sources that ask for an arch's feature set get it, and the plan
of its config.  GPU (`-m gpu`): 200 fresh random cases (b, n, h with 33..1024 rows and beyond, committed lengths
0 .. past l_max, tree / permuted / chain masks, 1..64 splits or the plan's, bf16 or fp32 out, PDL on and off) against
the reference with the bf16 tolerances of tests/test_tree_verify_mla_kernel.py, outputs and workspace poisoned with
NaN; a CUDA graph replaying new inputs; and the plan taking it with KDTREE_ATTN_WGMMA on.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch
from gpu_cases import gpu_cases
from test_tree_verify_mla_kernel import TOL, errors, graph_replay_errors, make_inputs, random_lens, reference

from plugins.tree_verify_mla import wgmma_launch

NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
def test_source_compiles_for_sm90a_with_wgmma_and_no_spills(tmp_path):
    from test_pdl_order_sass import _cuobjdump
    cubin = tmp_path / "k.cubin"
    res = subprocess.run([NVCC, "-O3", "-std=c++17", "-cubin", "-arch=sm_90a", "-Xptxas", "-v", "-o", str(cubin),
                          str(wgmma_launch.SOURCE)], capture_output=True, text=True, check=True)
    assert "0 bytes spill stores" in res.stderr and "0 bytes stack frame" in res.stderr, res.stderr
    regs = int(re.search(r"Used (\d+) registers", res.stderr).group(1))
    assert regs <= 255
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found")
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    assert sass.count("HGMMA.64x32x16.F32.BF16") == 36  # the scores: 576 / 16 k steps, unrolled
    assert sass.count("HGMMA.64x256x16.F32.BF16") == 4  # the values: 64 keys / 16


def test_launcher_shared_memory_is_the_sources():
    """The launcher's constants are the source's integer defines (SMEM_BYTES is checked against the layout there by
    a static_assert, which the compile above runs)."""
    defines = dict(re.findall(r"#define (\w+) (\d+)\b", wgmma_launch.SOURCE.read_text()))

    def value(name: str) -> int:
        return int(defines[name])

    assert value("SMEM_BYTES") + 1024 == wgmma_launch.SMEM <= 227 * 1024  # the slack aligns it to 1024 bytes
    assert value("BM") == wgmma_launch.BLOCK_M and value("BN") == wgmma_launch.BLOCK_N
    assert value("D_QK") == wgmma_launch.D_QK and value("D_V") == wgmma_launch.D_V
    assert value("THREADS") == wgmma_launch.THREADS


def test_sources_asking_for_the_feature_set_compile_for_it():
    from plugins.common.cubin import compile_arch
    text = wgmma_launch.SOURCE.read_bytes()
    assert compile_arch(text, "sm_90") == "sm_90a"
    assert compile_arch(text, "sm_120") == "sm_120"  # no wgmma there: the kernel traps, the launcher never asks
    assert compile_arch(b"__global__ void k() {}", "sm_90") == "sm_90"


def test_plan_of_the_wgmma_config():
    """Same plan rule as the Triton tiles (units = 64-row blocks, 64-key tiles); off the GPU it is never chosen."""
    from plugins.tree_verify_mla import launcher
    p = launcher.plan(1, 17, 8, 32768, torch.bfloat16, "cpu", config=launcher.WGMMA_CONFIG)
    assert p.config.wgmma and p.num_splits == 132 // 3  # 136 rows: three 64-row blocks a split
    p4 = launcher.plan(1, 17, 8, 4096, torch.bfloat16, "cpu", config=launcher.WGMMA_CONFIG)
    assert p4.num_splits == 23  # at 4K the partials' L2 cap binds (L2_SHARE)
    assert not launcher.plan(1, 17, 8, 32768, torch.bfloat16, "cpu").config.wgmma


def _case(gen: torch.Generator, i: int) -> dict:
    def pick(xs):
        return xs[int(torch.randint(0, len(xs), (1,), generator=gen))]
    h = pick([8, 8, 8, 16, 4, int(torch.randint(1, 65, (1,), generator=gen))])
    n = pick([5, 8, 9, 16, 17, 17, 31, 33, 64, 65, 100, 128, 200])
    b = pick([1, 1, 2, 3])
    l_max = pick([1, 63, 64, 65, 300, 1000, 4096, 4097, 32768])
    while b * n * h * (l_max + n) > 2e8:
        l_max = max(64, l_max // 2) if l_max > 64 else l_max
        if b * n * h * (l_max + n) > 2e8:
            n = max(1, n // 2)
    return {"b": b, "n": n, "h": h, "l_max": l_max, "lens": random_lens(gen, b, l_max),
            "kind": pick(["tree", "tree", "perm", "chain"]),
            "splits": None if i % 3 else int(torch.randint(1, 65, (1,), generator=gen)),
            "out_dtype": torch.float32 if i % 5 == 2 else torch.bfloat16, "pdl": i % 7 != 4}


@pytest.mark.gpu
def test_gpu_wgmma_matches_the_reference():
    from plugins.tree_verify_mla import launcher
    assert wgmma_launch.available(torch.device("cuda")), wgmma_launch._FUNCS.why_not
    gen = torch.Generator().manual_seed(2027)
    failures, worst = [], {"out_rel": 0.0, "lse_max_abs": 0.0}
    cases = gpu_cases(200)
    for i in range(cases):
        s = _case(gen, i)
        b, n, h, l_max = s["b"], s["n"], s["h"], s["l_max"]
        x = make_inputs(b, n, h, l_max, s["lens"], 512, 64, torch.bfloat16, gen, s["kind"], device="cuda")
        out = torch.full((b, n, h, 512), float("nan"), dtype=s["out_dtype"], device="cuda")
        lse = torch.full((b, n, h), float("nan"), dtype=torch.float32, device="cuda")
        cfg = launcher.WGMMA_CONFIG
        ws = torch.full((launcher.workspace_numel(b, n, h, 512, l_max, torch.bfloat16, "cuda", config=cfg,
                                                  num_splits=s["splits"]),), float("nan"), device="cuda")
        launcher.tree_verify_mla_triton(x["q"], x["cache"], x["cache_lens"], x["tree_kv"], x["tree_mask"],
                                        x["scale"], out, lse, workspace=ws, config=cfg, num_splits=s["splits"],
                                        pdl=s["pdl"])
        torch.cuda.synchronize()
        e = errors(out, lse, *reference(x, 512))
        for k in worst:
            worst[k] = max(worst[k], e[k])
        if not (e["all_written"] and e["out_rel"] <= TOL[torch.bfloat16][0]
                and e["lse_max_abs"] <= TOL[torch.bfloat16][1]):
            failures.append({k: v for k, v in s.items() if k != "out_dtype"} | e)
    print(f"tree_verify_wgmma: {cases} cases, {len(failures)} failures, worst {worst}")
    assert not failures, failures[:5]


@pytest.mark.gpu
def test_gpu_wgmma_is_planned_and_replays_in_a_graph(monkeypatch):
    import plugins.tree_verify_mla  # noqa: F401  (registers the CUDA kernel)
    from plugins.tree_verify_mla import launcher
    monkeypatch.setattr(launcher, "WGMMA", True)
    b, n, h, l_max = 2, 17, 8, 5000
    assert launcher.plan(b, n, h, l_max, torch.bfloat16, "cuda").config.wgmma
    assert launcher.plan(b, 4, h, l_max, torch.bfloat16, "cuda").config.wgmma  # 32 rows: with WGMMA_AR (default)
    monkeypatch.setattr(launcher, "WGMMA_AR", False)
    assert not launcher.plan(b, 4, h, l_max, torch.bfloat16, "cuda").config.wgmma  # without it the Triton tiles
    e = graph_replay_errors(b, n, h, l_max, 8)
    assert e["all_written"] and e["out_rel"] <= TOL[torch.bfloat16][0] and e["lse_max_abs"] <= TOL[torch.bfloat16][1], e
