"""kdtree::skinny_linear (plugins/dense_gemm): the Triton kernel against the torch reference, the entry checks,
the small-n rule and the launch configs.

CPU: the kernel under TRITON_INTERPRET=1 in a subprocess (the interpreter is chosen at import) on fresh random
inputs, fp32 and fp16 (the interpreter truncates fp32 -> bf16, so bf16 is checked on the GPU only), t in
{1, 3, 16, 17, 40}, odd n and k, strided x rows, with and without c, fp32 and model-dtype outputs, configs
whose blocks overhang t, n and k.  GPU (@pytest.mark.gpu): 200 K2.6-shaped bf16 cases against the fp64
reference, a row's bits independent of t for one config, the op's dispatch and a CUDA graph replay.

Letters: t tokens, n output features (W's rows), k input features.
"""

from __future__ import annotations

import json
import random
import sys

import pytest
import torch
from interpreter import interpreted

from plugins.dense_gemm import skinny_linear, skinny_linear_reference
from plugins.dense_gemm.config import (
    K26_SHAPES,
    GemmConfig,
    candidates,
    declines,
    default_config,
    pick_config,
    t_bucket,
)


def _inputs(t: int, n: int, k: int, dtype, strided: bool, with_c: bool, g: torch.Generator, device="cpu"):
    """x [t, k] (a view with row stride k + 7 when strided), w [n, k], c [t, n] or None: N(0, 1) / sqrt(k)
    weights, so outputs are O(1); never zeros."""
    base = torch.randn(t, k + (7 if strided else 0), generator=g).to(dtype)
    x = base[:, :k]  # [t, k]
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)  # [n, k]
    c = torch.randn(t, n, generator=g).to(dtype) if with_c else None  # [t, n]
    return [v.to(device) if v is not None else None for v in (x, w, c)]


def _bound(x, w, c, ref: torch.Tensor, out_dtype) -> torch.Tensor:
    """Per element: one rounding of the output (eps * |ref|) + fp32 summation error (2^-20 * sum |x||w|)."""
    mag = torch.nn.functional.linear(x.double().abs(), w.double().abs())  # [t, n]
    if c is not None:
        mag = mag + c.double().abs()
    return torch.finfo(out_dtype).eps * ref.double().abs() + 2.0 ** -20 * mag + 1e-30


def _max_excess(y, x, w, c, out_dtype) -> float:
    """max over elements of |y - ref64| / bound (<= 1 passes); the reference in fp64 on y's device."""
    ref = skinny_linear_reference(x.double(), w.double(), c, torch.float64)
    return ((y.double() - ref).abs() / _bound(x, w, c, ref, out_dtype)).max().item()


def interpreter_worker() -> list[dict]:
    """The CPU cases through the Triton kernel (run under TRITON_INTERPRET=1): [{case, excess}] plus the
    t-independence check."""
    from plugins.dense_gemm.kernel import skinny_linear_triton
    rng, g = random.Random(11), torch.Generator().manual_seed(11)
    out = []
    for dtype in (torch.float32, torch.float16):
        for t in (1, 3, 16, 17, 40):
            for with_c in (False, True):
                for out_fp32 in (False, True):
                    n, k = rng.choice([37, 61, 100, 129]), rng.choice([33, 69, 256, 321])
                    cfg = GemmConfig(rng.choice([16, 32, 64]), rng.choice([16, 32]), rng.choice([16, 64, 128]),
                                     rng.choice([2, 3]), 4)
                    x, w, c = _inputs(t, n, k, dtype, rng.random() < 0.7, with_c, g)
                    od = torch.float32 if out_fp32 else dtype
                    y = torch.full((t, n), float("nan"), dtype=od)  # every element must be written
                    skinny_linear_triton(x, w, c, y, cfg)
                    out.append({"case": f"{dtype} t={t} n={n} k={k} c={with_c} out={od} {cfg}",
                                "excess": _max_excess(y, x, w, c, od), "dtype": str(y.dtype)})
    # a real shape on its default config (q_b: 96 programs, k = 3 slices of 512)
    x, w, _ = _inputs(3, 1536, 1536, torch.float16, True, False, g)
    y = torch.empty(3, 1536, dtype=torch.float16)
    skinny_linear_triton(x, w, None, y, default_config(1536, 1536, 3, 132))
    out.append({"case": "q_b t=3 default", "excess": _max_excess(y, x, w, None, torch.float16), "dtype": str(y.dtype)})
    # t independence: token 0 alone and inside 17 tokens, one config
    cfg = GemmConfig(16, 16, 64, 3, 4)
    x, w, _ = _inputs(17, 70, 200, torch.float32, False, False, g)
    y1, y17 = torch.empty(1, 70), torch.empty(17, 70)
    skinny_linear_triton(x[:1], w, None, y1, cfg)
    skinny_linear_triton(x, w, None, y17, cfg)
    out.append({"case": "t independence", "same_bits": bool(torch.equal(y1[0], y17[0]))})
    return out


@pytest.fixture(scope="module")
def interpreter_results() -> list[dict]:
    return interpreted(__file__)


def test_kernel_matches_reference_in_interpreter(interpreter_results):
    cases = [r for r in interpreter_results if "excess" in r]
    assert len(cases) == 41
    assert {r["dtype"] for r in cases} == {"torch.float32", "torch.float16"}
    bad = [f"{r['case']}: {r['excess']:.3g}x the bound" for r in cases if not r["excess"] <= 1.0]  # NaN fails
    assert not bad, "\n".join(bad)


def test_row_does_not_depend_on_t_in_interpreter(interpreter_results):
    assert [r["same_bits"] for r in interpreter_results if "same_bits" in r] == [True]


# ---- entry checks, the small-n rule, configs (no kernel: the CPU op is the reference)

@pytest.mark.parametrize("make, word", [
    (lambda x, w, c: (x.to(torch.int32), w, c, None), "x must be bfloat16"),
    (lambda x, w, c: (x, w.half(), c, None), "w must be [n, k] of x's dtype"),
    (lambda x, w, c: (x, w[:, :-1].contiguous(), c, None), "w's k"),
    (lambda x, w, c: (x, w.t().contiguous().t(), c, None), "w must be contiguous"),
    (lambda x, w, c: (x.t(), w, c, None), "x must be [t, k]"),
    (lambda x, w, c: (x, w, c[:, :-1], None), "c must be"),
    (lambda x, w, c: (x, w, c.double(), None), "c must be"),
    (lambda x, w, c: (x, w, c, torch.float64), "out_dtype"),
])
def test_bad_inputs_raise_naming_the_tensor(make, word):
    g = torch.Generator().manual_seed(0)
    x, w, c = _inputs(3, 2112, 40, torch.float32, False, True, g)
    x2, w2, c2, od = make(x, w, c)
    with pytest.raises(ValueError, match=word.replace("[", r"\[").replace("]", r"\]")):
        skinny_linear(x2, w2, c2, od)


def test_small_n_declines_and_large_n_runs():
    g = torch.Generator().manual_seed(1)
    x, w, c = _inputs(5, 896, 64, torch.float32, True, True, g)
    assert declines(896, 132) and not declines(1536, 132) and not declines(2112, 132)
    assert skinny_linear(x, w, c) is None  # 56 row blocks < 66: the caller keeps cuBLAS
    forced = skinny_linear(x, w, c, config=GemmConfig())  # an explicit config runs whatever n is
    torch.testing.assert_close(forced, skinny_linear_reference(x, w, c, torch.float32))
    x, w, c = _inputs(5, 1536, 64, torch.float16, False, True, g)
    y = skinny_linear(x, w, c, torch.float32)
    assert y.dtype == torch.float32 and y.shape == (5, 1536)
    torch.testing.assert_close(y, skinny_linear_reference(x, w, c, torch.float32))


def test_default_configs_fill_the_sms_where_they_can():
    for name, (n, k, _, _) in K26_SHAPES.items():
        for t in (1, 2, 5, 9, 17, 33, 65, 257):
            cfg = default_config(n, k, t, 132)
            assert (cfg.block_m + cfg.block_n) * cfg.block_k * 2 <= 32 * 1024 and 3 <= cfg.stages <= 5, (name, cfg)
            if n >= 16 * 132:  # enough rows for one program per SM at block_n = 16
                assert cfg.programs(n, t) >= 132, (name, t, cfg)
            assert pick_config(n, k, t, 132) == cfg  # the table is empty until the H200 sweep
            alts = candidates(n, k, t, 132)
            assert alts[0] == cfg and len(set(alts)) == len(alts) <= 19
            assert all((a.block_m + a.block_n) * a.block_k * 2 * a.stages <= 160 * 1024 for a in alts[1:])
    assert default_config(2112, 7168, 1, 132) == GemmConfig(16, 16, 512, 4, 4)  # 132 programs, NOTES.md
    assert [t_bucket(t) for t in (1, 16, 17, 33, 64, 65, 257)] == [16, 16, 32, 64, 64, 1 << 30, 1 << 30]
    with pytest.raises(ValueError, match="block_n"):
        GemmConfig(block_n=8)
    with pytest.raises(ValueError, match="stages"):
        GemmConfig(stages=0)


def test_op_is_registered_with_a_fake_kernel():
    x = torch.empty(3, 7168, dtype=torch.bfloat16, device="meta")
    w = torch.empty(2112, 7168, dtype=torch.bfloat16, device="meta")
    y = skinny_linear(x, w, None, torch.float32)
    assert y.device.type == "meta" and y.shape == (3, 2112) and y.dtype == torch.float32
    assert hasattr(torch.ops.kdtree, "skinny_linear")


# ---- GPU

def gpu_cases(n_cases: int, seed: int = 5) -> list[str]:
    """n_cases random K2.6-shaped bf16 cases on the GPU against the fp64 reference: failures, in words."""
    from plugins.dense_gemm.kernel import skinny_linear_triton
    rng, dev = random.Random(seed), torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    weights = {name: (torch.randn(n, k, device=dev, generator=g) / k ** 0.5).to(torch.bfloat16)
               for name, (n, k, _, _) in K26_SHAPES.items()}  # [n, k] each, drawn once
    failures = []
    for i in range(n_cases):
        name = rng.choice(list(K26_SHAPES))
        n, k, out, with_c = K26_SHAPES[name]
        t = rng.choice([1, 1, 2, 5, 9, 16, 17, 33, 64, 65, rng.randint(1, 65), 257])
        od = torch.float32 if out == "fp32" or rng.random() < 0.1 else torch.bfloat16
        w = weights[name]
        xb = torch.randn(t, k + rng.choice([0, 64]), device=dev, generator=g).to(torch.bfloat16)
        x = xb[:, :k]  # [t, k], strided rows in some cases
        c = torch.randn(t, n, device=dev, generator=g).to(torch.bfloat16) if with_c else None
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        cfg = pick_config(n, k, t, sms) if rng.random() < 0.9 else rng.choice(candidates(n, k, t, sms)[1:4])
        y = torch.full((t, n), float("nan"), dtype=od, device=dev)
        skinny_linear_triton(x, w, c, y, cfg)
        excess = _max_excess(y, x, w, c, od)
        if not excess <= 1.0:
            failures.append(f"case {i}: {name} t={t} out={od} {cfg}: {excess:.3g}x the bound")
    return failures


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_k26_shapes_bf16_against_fp64():
    failures = gpu_cases(200)
    assert not failures, f"{len(failures)} of 200 failed:\n" + "\n".join(failures[:20])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_row_bits_do_not_depend_on_t():
    from plugins.dense_gemm.kernel import skinny_linear_triton
    for name, (n, k, out, with_c) in K26_SHAPES.items():
        x, w, c = _inputs(17, n, k, torch.bfloat16, True, with_c, torch.Generator().manual_seed(3), "cuda")
        od = torch.float32 if out == "fp32" else torch.bfloat16
        for cfg in {pick_config(n, k, 1, 132), pick_config(n, k, 17, 132)}:
            y1 = torch.empty(1, n, dtype=od, device="cuda")
            y17 = torch.empty(17, n, dtype=od, device="cuda")
            for row in (0, 16):  # the first token block, and the second one's first row when block_m = 16
                skinny_linear_triton(x[row:row + 1], w, c[row:row + 1] if with_c else None, y1, cfg)
                skinny_linear_triton(x, w, c, y17, cfg)
                assert torch.equal(y1[0], y17[row]), (name, cfg, row)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_dispatch_and_graph_replay():
    from plugins.dense_gemm.kernel import skinny_linear_triton
    gen = torch.Generator().manual_seed(4)
    x, w, c = _inputs(9, 7168, 256, torch.bfloat16, False, True, gen, "cuda")
    y = skinny_linear(x, w, c)  # the kdtree op's CUDA kernel
    direct = torch.empty_like(y)
    skinny_linear_triton(x, w, c, direct, pick_config(7168, 256, 9, torch.cuda.get_device_properties(0)
                                                      .multi_processor_count))
    assert torch.equal(y, direct)
    assert skinny_linear(x, torch.empty(896, 256, dtype=torch.bfloat16, device="cuda")) is None
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        captured = skinny_linear(x, w, c)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, skinny_linear(x, w, c))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--interpreter"]:
        print(json.dumps(interpreter_worker()))
