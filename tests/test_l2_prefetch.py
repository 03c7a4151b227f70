"""plugins/l2_prefetch: a prefetch is a hint (a GEMM after it gives the same bits, in a graph too); bad input is
refused with a message naming what is wrong; the source compiles for sm_90 and sm_80 (its fallback path)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from plugins.l2_prefetch.launch import SOURCE, prefetch_l2

NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)


def test_refuses_cpu_and_misaligned_tensors():
    with pytest.raises(ValueError, match="contiguous CUDA tensor"):
        prefetch_l2(torch.zeros(8))
    with pytest.raises(ValueError, match="contiguous CUDA tensor"):
        prefetch_l2(torch.zeros(8, 8).t())


@pytest.mark.skipif(NVCC is None, reason="no nvcc")
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_source_compiles(tmp_path, arch):
    out = tmp_path / "k.cubin"
    subprocess.run([NVCC, f"-arch={arch}", "-cubin", "-o", str(out), str(SOURCE)], check=True)
    assert out.stat().st_size > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_prefetch_changes_no_result():
    from plugins.l2_prefetch.launch import spin
    torch.manual_seed(1)
    dev = torch.device("cuda")
    for n, k, t in ((2112, 7168, 1), (7168, 1024, 16), (96, 40, 3)):
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        x = torch.randn(t, k, device=dev, dtype=torch.bfloat16)
        want = x @ w.t()
        prefetch_l2(w)
        spin(1000, dev)
        assert torch.equal(x @ w.t(), want)
        prefetch_l2(w, evict_last=True)
        assert torch.equal(x @ w.t(), want)
        prefetch_l2(w, chunk=8192, threads=32)  # spread: one warp an SM
        assert torch.equal(x @ w.t(), want)
        g = torch.cuda.CUDAGraph()
        out = torch.empty_like(want)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
            prefetch_l2(w)
            torch.mm(x, w.t(), out=out)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
    with pytest.raises(ValueError, match="multiples of 16"):
        prefetch_l2(torch.zeros(3, device=dev, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="threads"):
        prefetch_l2(torch.zeros(64, device=dev, dtype=torch.bfloat16), threads=0)


def test_the_op_is_a_no_op_off_cuda_and_takes_at_most_four():
    from plugins.l2_prefetch import l2_prefetch
    w = torch.randn(8, 4)
    l2_prefetch([w, w.t()])  # nothing happens on CPU, whatever the layout
    assert str(torch.ops.kdtree.l2_prefetch.default._schema) == "kdtree::l2_prefetch(Tensor[] weights) -> ()"
    with pytest.raises(ValueError, match="at most 4 tensors"):
        l2_prefetch([w] * 5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_gemm_prefetch_changes_no_token(tiny, tmp_path, monkeypatch):
    """KDTREE_GEMM_PREFETCH's L2 prefetch before each layer's attention (runtime/model/attention.py) adds a hint
    kernel to the round and nothing else: the tiny INT4 model's tokens are the same bits, AR and DDTree, graphs on."""
    import runtime.model.attention as attention
    from build_pipeline.tiny_drafter import make_tiny_drafter
    from plugins.l2_prefetch.launch import prefetch_regions_l2
    from runtime.engine.engine import Engine

    path, drafter = tiny.get("kimi", int4=True, kimi25=True), tmp_path / "drafter"
    make_tiny_drafter(path, drafter)
    prompt = list(range(3, 40, 3))
    runs = {}
    for on in (False, True):
        monkeypatch.setattr(attention, "GEMM_PREFETCH", on)
        for spec, budget in (("none", None), ("ddtree", 8)):
            eng = Engine.load(path, device="cuda", drafter=drafter if budget else None, spec=spec, budget=budget)
            runs[(on, spec)] = list(eng.generate_ids(prompt, 24))
            assert eng.last_stats["graphs"]
    assert runs[(True, "none")] == runs[(False, "none")]
    assert runs[(True, "ddtree")] == runs[(False, "ddtree")]
    w = torch.randn(96, 40, device="cuda").bfloat16()
    with pytest.raises(ValueError, match="at most 4"):
        prefetch_regions_l2([w] * 5)
