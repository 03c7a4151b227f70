"""The attention's split combine folded into the v absorption (plugins/layer_fusion/combine_absorb.py) against the
unfused path: the fold kernel against a torch combine-then-absorb (fresh random partials, never zeros: 2, 3, 5, 12
and 129 splits, empty splits whose rows hold NaN, a row no split saw, t = 1 and 17, bf16 / fp32), the split kernel
alone (kdtree::tree_verify_mla_partials' CUDA path: with one split it writes o_lat, which mla_v_absorb reads) plus the
fold against tree_verify_mla then mla_v_absorb, and mla_forward with FUSED_COMBINE on against off.

CPU: the Triton launchers under TRITON_INTERPRET=1 in a subprocess (for mla_forward the two attention ops' CPU
kernels are their CUDA launchers there, as tests/test_round_interpreted.py does).  GPU (-m gpu): K2.6 decode
shapes (8 heads, c 512, u 128, a 4K cache, the planner's splits) against the unfused kernels.

Tolerance: the merge's summation order may round a merged bf16 latent element one ulp apart (the interpreter
truncates fp32 -> bf16), and the dot sums in another order: |got - want| <= 4 ulp x the dot of the absolute values.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from interpreter import interpreted, interpreter_shims
from test_tree_verify_mla_kernel import make_inputs

ROOT = Path(__file__).resolve().parent.parent
ULP = {torch.bfloat16: 2 ** -7, torch.float32: 2e-6}
NEG_INF = float("-inf")


def _within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> tuple[bool, float]:
    """(ok, max error over the bound): finite, and within 4 ulp of got's dtype times bound (fp64)."""
    diff = (got.double() - want.double()).abs()
    ok = bool(torch.isfinite(got).all() and (diff <= 4 * ULP[got.dtype] * bound + 1e-30).all())
    return ok, float((diff / bound.clamp_min(1e-30)).max())


def _abs_bound(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """[t, h, u] = |o_lat| . |W_UV|^T per head in fp64: the scale of a summation-order difference."""
    return torch.einsum("thc,huc->thu", o_lat.double().abs(), w_uv.double().abs())


def random_partials(b: int, s: int, m: int, c: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """o_part [b, s, m, c], l_part [b, s, m] as the split kernel leaves them: about a quarter of the (split, row)
    pairs empty (lse -inf, their o rows NaN: never to be read), row 0 of request 0 seen by no split."""
    o_part = torch.randn(b, s, m, c, generator=gen)
    l_part = torch.randn(b, s, m, generator=gen) * 4 + 10
    empty = torch.rand(b, s, m, generator=gen) < 0.25
    empty[0, :, 0] = True
    l_part[empty] = NEG_INF
    o_part[empty] = float("nan")
    return o_part, l_part


def fold_cases() -> list[dict]:
    """The fold kernel against mla_combine_v_absorb_reference: (b, n, h, c, u, s, dtype) with t = b * n."""
    from plugins.layer_fusion.combine_absorb import mla_combine_v_absorb_triton
    from plugins.layer_fusion.reference import combine_partials_reference, mla_combine_v_absorb_reference
    out = []
    cases = [(1, 1, 3, 64, 32, 2, torch.bfloat16), (1, 1, 2, 64, 48, 5, torch.bfloat16),
             (1, 17, 2, 32, 32, 3, torch.bfloat16), (2, 1, 3, 64, 32, 12, torch.bfloat16),
             (1, 17, 1, 64, 16, 2, torch.float32), (1, 1, 2, 512, 128, 3, torch.bfloat16),
             (1, 1, 2, 64, 32, 129, torch.bfloat16)]  # K2.6's AR plan at 4K: 32-column slices of 256 padded splits
    for i, (b, n, h, c, u, s, dt) in enumerate(cases):
        gen = torch.Generator().manual_seed(100 + i)
        o_part, l_part = random_partials(b, s, n * h, c, gen)
        w_uv = (torch.randn(h, u, c, generator=gen) * 0.1).to(dt)
        got = torch.full((b * n, h, u), float("nan"), dtype=dt)
        mla_combine_v_absorb_triton(o_part, l_part, w_uv, got)
        want = mla_combine_v_absorb_reference(o_part, l_part, w_uv)
        o_lat = combine_partials_reference(o_part, l_part, dt).view(b * n, h, c)
        ok, err = _within(got, want, _abs_bound(o_lat, w_uv))
        unseen = bool((got[0, 0] == 0).all())  # the row no split saw: 0, as the combine writes it
        out.append(dict(op="fold", case=f"b{b} n{n} h{h} c{c} u{u} s{s} {dt}", ok=ok and unseen, err=err))
    return out


def fused_attention(args: tuple, w_uv: torch.Tensor, splits: int | None = None) -> torch.Tensor:
    """mla_forward's FUSED_COMBINE path through the launchers: the split kernel alone, then the fold (with one split
    the split kernel writes o_lat and mla_v_absorb reads it); o [b*n, h, u]."""
    from plugins.layer_fusion.combine_absorb import mla_combine_v_absorb_triton
    from plugins.layer_fusion.kernel import mla_v_absorb_triton
    from plugins.tree_verify_mla.launcher import tree_verify_mla_triton
    b, n, h, _ = args[0].shape
    o_lat = torch.full((b, n, h, w_uv.shape[2]), float("nan"), dtype=w_uv.dtype, device=w_uv.device)
    lse = torch.empty(b, n, h, device=w_uv.device)
    o = torch.full((b * n, h, w_uv.shape[1]), float("nan"), dtype=w_uv.dtype, device=w_uv.device)
    parts = tree_verify_mla_triton(*args, o_lat, lse, num_splits=splits, combine=False)
    if parts is None:
        mla_v_absorb_triton(o_lat.flatten(0, 1), w_uv, o)
    else:
        mla_combine_v_absorb_triton(*parts, w_uv, o)
    return o


def unfused_attention(args: tuple, w_uv: torch.Tensor, splits: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """tree_verify_mla_triton (split + combine), then mla_v_absorb_triton: (o [b*n, h, u], o_lat [b*n, h, c])."""
    from plugins.layer_fusion.kernel import mla_v_absorb_triton
    from plugins.tree_verify_mla.launcher import tree_verify_mla_triton
    b, n, h, _ = args[0].shape
    o_lat = torch.empty(b, n, h, w_uv.shape[2], dtype=w_uv.dtype, device=w_uv.device)
    lse = torch.empty(b, n, h, device=w_uv.device)
    tree_verify_mla_triton(*args, o_lat, lse, num_splits=splits)
    o = torch.empty(b * n, h, w_uv.shape[1], dtype=w_uv.dtype, device=w_uv.device)
    mla_v_absorb_triton(o_lat.flatten(0, 1), w_uv, o)
    return o, o_lat.flatten(0, 1)


def attention_cases() -> list[dict]:
    """The split kernel plus fold against the unfused kernels: one split (mla_v_absorb reads the o_lat the split
    kernel wrote), 3 splits, the planner's (5 here)."""
    out = []
    for i, (b, n, h, lens, splits) in enumerate([(2, 1, 4, [70, 9], 1), (2, 5, 2, [70, 0], 3), (1, 17, 2, [61], None)]):
        gen = torch.Generator().manual_seed(200 + i)
        x = make_inputs(b, n, h, 70, lens, 64, 32, torch.bfloat16, gen)
        args = (x["q"], x["cache"], x["cache_lens"], x["tree_kv"], x["tree_mask"], x["scale"])
        w_uv = (torch.randn(h, 32, 64, generator=gen) * 0.1).to(torch.bfloat16)
        want, o_lat = unfused_attention(args, w_uv, splits)
        ok, err = _within(fused_attention(args, w_uv, splits), want, _abs_bound(o_lat, w_uv))
        out.append(dict(op="attention", case=f"b{b} n{n} h{h} lens{lens} splits {splits}", ok=ok, err=err))
    return out


def forward_cases() -> list[dict]:
    """mla_forward on a tiny-kimi layer (bf16, 4 heads, c 64, u 32) with FUSED_COMBINE on against off, its `is_cuda`
    branches taken and the attention ops' CPU kernels being their CUDA functions (as test_round_interpreted.py; the
    other ops run their references); an AR step and a 17-token tree, two requests."""
    from test_round_interpreted import _as_launched

    from benchmarks.launch_count import cuda_branches
    from plugins.common.bitmask import causal_mask
    from plugins.common.op import LIB, OPS
    from plugins.layer_fusion import combine_absorb
    from plugins.tree_verify_mla.launcher import plan
    from runtime.load.synthetic import draw_models
    from runtime.model import attention

    for name in ("tree_verify_mla", "tree_verify_mla_partials", "mla_combine_v_absorb"):
        LIB.impl(name, _as_launched(OPS[name].cuda_kernel), "CPU")
    folds = []
    launch = combine_absorb.mla_combine_v_absorb_triton
    combine_absorb.mla_combine_v_absorb_triton = lambda *a, **k: folds.append(1) or launch(*a, **k)
    torch.manual_seed(0)
    target, _ = draw_models("tiny-kimi", None, layers=2, dtype=torch.bfloat16, device="cpu")
    cfg, lw = target.cfg, target.w.layers[1]
    out = []
    for n in (1, 17):
        b, cap = 2, 96
        cache = target.new_cache(b, cap, n)
        gen = torch.Generator().manual_seed(n)
        cache.kv.copy_(torch.randn(cache.kv.shape, generator=gen).to(torch.bfloat16))
        cache.lens.copy_(torch.tensor([90, 37], dtype=torch.int32))
        x = torch.randn(b, n, cfg.hidden_size, generator=gen).to(torch.bfloat16)
        cos, sin = target.rope.cos_sin(cache.lens[:, None].long() + torch.arange(n), torch.bfloat16)
        res, ran = {}, True
        for fused in (False, True):
            attention.FUSED_COMBINE = fused
            folded = len(folds)
            with cuda_branches():
                res[fused] = attention.mla_forward(cfg, lw.attn, target.rope, x, cos, sin, cache.kv[1], cache.lens,
                                                   cache.scratch[1], causal_mask(b, n), cache.work)
            ran = ran and len(folds) - folded == fused  # the fold kernel ran exactly where the switch is on
        attention.FUSED_COMBINE = False
        splits = plan(b, n, lw.attn.w_uk.shape[0], cap, torch.bfloat16, "cpu").num_splits
        want, got = res[False].float(), res[True].float()
        scale = float(want.abs().max())
        ok = ran and splits > 1 and torch.allclose(got, want, rtol=2e-2, atol=2e-2 * scale)
        out.append(dict(op="forward", case=f"b{b} n{n} splits {splits}", ok=bool(ok),
                        err=float((got - want).abs().max()) / scale))
    return out


@pytest.fixture(scope="module")
def interpreter_results():
    return interpreted(__file__)


@pytest.mark.parametrize("op", ["fold", "attention", "forward"])
def test_interpreted_against_the_unfused_path(interpreter_results, op):
    cases = [c for c in interpreter_results if c["op"] == op]
    assert cases and all(c["ok"] for c in cases), [c for c in cases if not c["ok"]]


def test_cpu_ops_are_the_unfused_references():
    """On CPU tree_verify_mla_partials is the reference attention (o_lat written, no partials), so FUSED_COMBINE's
    path is bit for bit the unfused one; mla_combine_v_absorb is its reference, the combine then the absorption."""
    from plugins.layer_fusion import mla_combine_v_absorb
    from plugins.layer_fusion.reference import mla_combine_v_absorb_reference
    from plugins.tree_verify_mla import tree_verify_mla, tree_verify_mla_partials
    gen = torch.Generator().manual_seed(5)
    x = make_inputs(2, 3, 2, 40, [40, 7], 64, 32, torch.bfloat16, gen)
    args = (x["q"], x["cache"], x["cache_lens"], x["tree_kv"], x["tree_mask"], x["scale"])
    o_lat, lse = torch.empty(2, 3, 2, 64, dtype=torch.bfloat16), torch.empty(2, 3, 2)
    tree_verify_mla(*args, o_lat, lse)
    got_lat, got_lse = torch.full_like(o_lat, float("nan")), torch.full_like(lse, float("nan"))
    o_part, l_part = tree_verify_mla_partials(*args, got_lat, got_lse)
    assert o_part.shape == (2, 0, 6, 64) and l_part.shape == (2, 0, 6)
    assert torch.equal(got_lat, o_lat) and torch.equal(got_lse, lse)
    o_part, l_part = random_partials(2, 3, 6, 64, gen)
    w_uv = torch.randn(2, 32, 64, generator=gen).to(torch.bfloat16)
    assert torch.equal(mla_combine_v_absorb(o_part, l_part, w_uv), mla_combine_v_absorb_reference(o_part, l_part, w_uv))


def test_aot_lists_every_split_padding_of_the_plan():
    """plugins/layer_fusion/aot.py keeps its own copy of tree_verify_mla's MAX_SPLITS (ops import no other op)."""
    from plugins.layer_fusion import aot
    from plugins.tree_verify_mla.launcher import MAX_SPLITS
    assert aot.MAX_SPLITS == MAX_SPLITS
    pads = sorted(k.constexprs["S_PAD"] for k in aot.aot_kernels(()))
    assert pads == [1 << i for i in range(1, MAX_SPLITS.bit_length())]


@pytest.mark.slow
def test_aot_kernels_compile_for_sm90(tmp_path):
    """plugins/layer_fusion/aot.py through the build's Triton AOT step (its subprocess, without TRITON_INTERPRET):
    a cubin per S_PAD, each waiting for the split kernel's grid before it reads a partial."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    proc = subprocess.run([sys.executable, "-m", "build_pipeline.compile_kernels", "--out", str(tmp_path), "--arch",
                           "sm_90", "--modules", "plugins.layer_fusion.aot"], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(recs) == 9
    for r in recs:
        assert (tmp_path / r["cubin"]).read_bytes()[:4] == b"\x7fELF", r
        ptx = (tmp_path / r["ptx"]).read_text()
        first_read = min(i for i in (ptx.find("ld.global"), ptx.find("cp.async")) if i >= 0)
        assert -1 < ptx.find("griddepcontrol.wait") < first_read, r["name"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("b,n", [(1, 1), (2, 1), (1, 17)])
def test_gpu_k26_decode_shapes_match_the_unfused_kernels(b, n):
    """8 heads, c 512, u 128, a 4K cache (the planner's splits: 129 at t = 1, 22 at t = 17); records nothing."""
    from plugins.tree_verify_mla.launcher import plan
    gen = torch.Generator().manual_seed(17 * b + n)
    h, l_max = 8, 4096
    lens = [int(v) for v in torch.randint(l_max - 64, l_max + 1, (b,), generator=gen)]
    x = make_inputs(b, n, h, l_max, lens, 512, 64, torch.bfloat16, gen, device="cuda")
    args = (x["q"], x["cache"], x["cache_lens"], x["tree_kv"], x["tree_mask"], x["scale"])
    w_uv = (torch.randn(h, 128, 512, generator=gen) * 0.05).to("cuda", torch.bfloat16)
    assert plan(b, n, h, l_max, torch.bfloat16, "cuda").num_splits > 1
    want, o_lat = unfused_attention(args, w_uv)
    got = fused_attention(args, w_uv)
    torch.cuda.synchronize()
    ok, err = _within(got, want, _abs_bound(o_lat, w_uv))
    assert ok, err
    assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2 * float(want.float().abs().max()))


if __name__ == "__main__" and "--interpreter" in sys.argv:
    interpreter_shims()
    print(json.dumps(fold_cases() + attention_cases() + forward_cases()))
