"""plugins/layer_fusion kernels against their references (reference.py: the layer's torch ops).

Fresh random inputs (never zeros) at awkward sizes (d 7, 100, 7168; c 512 and 24; r 64 and 6; rows 1,
3, 17, 130), bf16 / fp16 / fp32, interleaved and half-split rope, strided inputs (q_b's output viewed
per head, the bmm's [h, t, c] output read transposed, the cache's scratch rows written in place).
bf16 / fp16 must be bit-identical except where the RMS reduction's order shows (<= 1 ulp of the
storage dtype on a few elements); fp32 within 2e-6 relative.

CPU: the Triton launchers under TRITON_INTERPRET=1 in a subprocess (the interpreter is chosen when
triton is imported), a few cases per op, fp16 and fp32 (the interpreter truncates fp32 -> bf16).
GPU (-m gpu): hundreds of cases per op, and the ops
dispatching to the kernels.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from gpu_cases import gpu_cases
from interpreter import interpreted

from plugins.layer_fusion.reference import (
    add_rms_norm_reference,
    drafter_block_reference,
    embed_norm_rope_reference,
    embed_range_reference,
    kv_norm_rope_store_reference,
    mla_q_absorb_reference,
    mla_rope_kv_reference,
    mla_v_absorb_reference,
    rms_norm_reference,
    rope_cos_sin_reference,
    silu_mul_reference,
)

ULP = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 2e-6, torch.float64: 1e-12}


def _within_dot_bound(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> tuple[bool, float]:
    """(ok, max error over the bound): a product in another summation order, finite and within 4 ulp of got's dtype
    times bound, the dot of the operands' absolute values (fp64)."""
    diff = (got.double() - want.double()).abs()
    ok = bool(torch.isfinite(got).all() and (diff <= 4 * ULP[got.dtype] * bound + 1e-30).all())
    return ok, float((diff / bound.clamp_min(1e-30)).max())


def _close(got: torch.Tensor, want: torch.Tensor, exact: bool) -> tuple[bool, float]:
    """(ok, max relative error): exact ops match bit for bit; the others within 2 ulp of the storage dtype
    (the RMS's summation order moves a few results by one ulp)."""
    g, w = got.float(), want.float()
    if not torch.isfinite(g).all():
        return False, float("inf")
    err = float(((g - w).abs() / w.abs().clamp_min(1e-3)).max()) if g.numel() else 0.0
    if exact:
        return bool(torch.equal(got, want)), err
    return err <= 2 * ULP[got.dtype], err


def run_cases(device: str, count: int, seed: int = 0) -> list[dict]:
    """count random cases per op through the Triton launchers; one record per case."""
    from plugins.layer_fusion import kernel as fusion_kernel
    from plugins.layer_fusion.kernel import (
        add_rms_norm_triton,
        drafter_block_triton,
        embed_norm_rope_triton,
        embed_range_triton,
        kv_norm_rope_store_triton,
        mla_q_absorb_triton,
        mla_rope_kv_triton,
        mla_v_absorb_triton,
        rope_cos_sin_triton,
        silu_mul_triton,
    )

    g = torch.Generator(device="cpu").manual_seed(seed)
    # Triton 3.6's interpreter truncates fp32 -> bf16 (no round-to-nearest-even): bf16 is checked on the GPU
    dtypes = (torch.bfloat16, torch.float16, torch.float32) if device == "cuda" else (torch.float16, torch.float32)

    def rnd(*shape, dtype, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    def early(launch, *args):  # the launch again with the kernels' weights loaded before the PDL wait (or after)
        before, fusion_kernel.EARLY_WEIGHTS = fusion_kernel.EARLY_WEIGHTS, not fusion_kernel.EARLY_WEIGHTS
        try:
            launch(*args)
        finally:
            fusion_kernel.EARLY_WEIGHTS = before

    out = []
    for k in range(count):
        dt = dtypes[k % len(dtypes)]
        t = pick((1, 3, 17, 130))
        # add_rms_norm (with one or two deltas) and plain rms_norm; strided rows (a view of a wider buffer)
        d = pick((7, 100, 7168))
        x, b2, w = rnd(t, d, dtype=dt, scale=3), rnd(t, d, dtype=dt), rnd(d, dtype=dt)
        wide = rnd(t, d + 5, dtype=dt)[:, 2:d + 2]
        s, y = torch.empty_like(x), torch.empty_like(x)
        delta2 = b2 if k % 2 else None
        add_rms_norm_triton(x, wide, delta2, w, 1e-6, s, y)
        ws, wy = add_rms_norm_reference(x, wide, delta2, w, 1e-6)
        ok_s, _ = _close(s, ws, exact=True)
        ok_y, err = _close(y, wy, exact=False)
        s_e, y_e = torch.empty_like(x), torch.empty_like(x)
        early(add_rms_norm_triton, x, wide, delta2, w, 1e-6, s_e, y_e)
        ok_s = ok_s and torch.equal(s_e, s) and torch.equal(y_e, y)  # its weight row loaded before the wait or after
        out.append(dict(op="add_rms_norm", case=f"t{t} d{d} {dt} delta2={delta2 is not None}", ok=ok_s and ok_y,
                        err=err))
        y2 = torch.empty_like(x)
        add_rms_norm_triton(wide, None, None, w, 1e-5, None, y2)
        ok, err = _close(y2, rms_norm_reference(wide, w, 1e-5), exact=False)
        out.append(dict(op="rms_norm", case=f"t{t} d{d} {dt}", ok=ok, err=err))

        # mla_q_absorb: q [t, h, p+r] from a [t, h*(p+r)] GEMM output, W_UK [h, p, c]; the product within 4 ulp of
        # the dot's absolute-value bound (summation order), the rope part bit for bit
        h, p, c, r2 = pick((1, 8, 16)), pick((128, 16, 24)), pick((512, 24)), pick((32, 3))
        interleave = bool(k % 2)
        q = rnd(t, h * (p + 2 * r2), dtype=dt).view(t, h, p + 2 * r2)
        w_uk = rnd(h, p, c, dtype=dt, scale=0.1)
        cos, sin = rnd(t, r2, dtype=dt), rnd(t, r2, dtype=dt)
        got = torch.empty(t, h, c + 2 * r2, dtype=dt, device=device)
        mla_q_absorb_triton(q, w_uk, cos, sin, interleave, got)
        want = mla_q_absorb_reference(q, w_uk, cos, sin, interleave)
        bound = torch.bmm(q[..., :p].transpose(0, 1).double().abs(), w_uk.double().abs()).transpose(0, 1)  # [t, h, c]
        ok, err = _within_dot_bound(got[..., :c], want[..., :c], bound)
        ok = ok and bool(torch.isfinite(got).all()) and torch.equal(got[..., c:], want[..., c:])
        got_e = torch.empty_like(got)
        early(mla_q_absorb_triton, q, w_uk, cos, sin, interleave, got_e)
        ok = ok and torch.equal(got_e, got)  # the same tile and dot, its load before the wait or after
        out.append(dict(op="mla_q_absorb", case=f"t{t} h{h} p{p} c{c} r{2 * r2} {dt} il={interleave}", ok=ok, err=err))

        # rope_cos_sin: positions up to 256K (the angles reach ~2.6e5 rad), the YaRN factor as scale; exact on the GPU
        # (libdevice's cos / sin are the CUDA math library's, as torch's), within 2 ulp under the interpreter (NumPy)
        if dt != torch.bfloat16 or device == "cuda":
            r2 = pick((32, 3))
            pos = torch.randint(0, 1 << 18, (t,), generator=g).to(device)
            inv = (1.0 / (10000.0 ** (torch.arange(r2, dtype=torch.float32) / r2))).to(device)
            cs, sn = torch.empty(t, r2, dtype=dt, device=device), torch.empty(t, r2, dtype=dt, device=device)
            rope_cos_sin_triton(pos, inv, 1.25, cs, sn)
            wc, ws_ = rope_cos_sin_reference(pos, inv, 1.25, dt)
            exact = device == "cuda"
            (ok_c, err_c), (ok_s, err_s) = _close(cs, wc, exact), _close(sn, ws_, exact)
            out.append(dict(op="rope_cos_sin", case=f"t{t} r{2 * r2} {dt}", ok=ok_c and ok_s, err=max(err_c, err_s)))

        # mla_v_absorb: o_lat read through [h, t, c] strides (the bmm's view), W_UV [h, u, c]; the same bound
        u = pick((128, 16, 20))
        o_lat = rnd(h, t, c, dtype=dt).transpose(0, 1)  # [t, h, c] strided
        w_uv = rnd(h, u, c, dtype=dt, scale=0.1)
        got = torch.empty(t, h, u, dtype=dt, device=device)
        mla_v_absorb_triton(o_lat, w_uv, got)
        want = mla_v_absorb_reference(o_lat, w_uv)
        bound = torch.bmm(o_lat.transpose(0, 1).double().abs(), w_uv.double().abs().transpose(1, 2)).transpose(0, 1)
        ok, err = _within_dot_bound(got, want, bound)
        got_e = torch.empty_like(got)
        early(mla_v_absorb_triton, o_lat, w_uv, got_e)  # at decode sizes one dot over the whole width
        ok_e, err_e = _within_dot_bound(got_e, want, bound)
        got_n = torch.empty_like(got)
        tree, fusion_kernel.V_ABSORB_TREE = fusion_kernel.V_ABSORB_TREE, not fusion_kernel.V_ABSORB_TREE
        try:  # the other u block width up to 32 tokens
            mla_v_absorb_triton(o_lat, w_uv, got_n)
        finally:
            fusion_kernel.V_ABSORB_TREE = tree
        ok_n, err_n = _within_dot_bound(got_n, want, bound)
        ok, err = ok and ok_e and ok_n, max(err, err_e, err_n)
        out.append(dict(op="mla_v_absorb", case=f"t{t} h{h} c{c} u{u} {dt}", ok=ok, err=err))

        # mla_rope_kv: into scratch rows [b, n, c+r] of a [b, n_max, c+r] buffer; untouched rows stay
        bq = pick((1, 2, 3))
        n = max(1, t // bq)
        latent = rnd(bq * n, c + 2 * r2, dtype=dt, scale=2)
        wn = rnd(c, dtype=dt)
        cos, sin = rnd(bq * n, r2, dtype=dt), rnd(bq * n, r2, dtype=dt)
        scratch = rnd(bq, n + 4, c + 2 * r2, dtype=dt)
        want = scratch.clone()
        # odd cases: with the query's low-rank row, read from the columns before the latent's in one GEMM output
        ql = qw = q_got = q_want = None
        if k % 2:
            qd = pick((1536, 24))
            ql = rnd(bq * n, qd + c + 2 * r2 + 3, dtype=dt, scale=2)[:, :qd]
            qw, q_got, q_want = rnd(qd, dtype=dt), rnd(bq * n, qd, dtype=dt), rnd(bq * n, qd, dtype=dt)
        mla_rope_kv_triton(latent, wn, 1e-6, cos, sin, interleave, scratch[:, :n], ql, qw, q_got)
        mla_rope_kv_reference(latent, wn, 1e-6, cos, sin, interleave, want[:, :n], ql, qw, q_want)
        ok_rows, err = _close(scratch[:, :n], want[:, :n], exact=False)
        ok_pe, _ = _close(scratch[:, :n, c:], want[:, :n, c:], exact=True)
        ok_q, q_err = (True, 0.0) if ql is None else _close(q_got, q_want, exact=False)
        out.append(dict(op="mla_rope_kv", case=f"b{bq} n{n} c{c} r{2 * r2} {dt} il={interleave} q={ql is not None}",
                        ok=ok_rows and ok_pe and ok_q and torch.equal(scratch[:, n:], want[:, n:]),
                        err=max(err, q_err)))

        # silu_mul: gate_up [t, 2i] rows of a wider buffer
        hh, e = pick((1, 4, 8)), pick((128, 16, 6))
        # kv_norm_rope_store: the drafter's k heads (norm + rope) of 1-3 layers into the cache rows of their
        # positions (distinct rows; the last token of a request may sit past the cache: clamped to its last row), the
        # v heads copied as they are
        bq, n, cap, ly = pick((1, 2, 3)), pick((1, 5, 8)), pick((12, 40)), pick((1, 3))
        pos = torch.stack([torch.randperm(cap - 1, generator=g)[:n] for _ in range(bq)])  # [bq, n] < cap - 1
        if k % 2:
            pos[:, -1] = cap + int(torch.randint(0, 5, (1,), generator=g))
        pos = pos.to(device)
        width = ly * 2 * hh * e
        kv = rnd(bq * n, width + 3, dtype=dt, scale=2)[:, :width].view(bq * n, ly, 2, hh, e)
        kn = rnd(ly, e, dtype=dt)
        cos, sin = rnd(bq * n, e // 2, dtype=dt), rnd(bq * n, e // 2, dtype=dt)
        kc, vc = rnd(ly, bq, cap, hh, e, dtype=dt), rnd(ly, bq, cap, hh, e, dtype=dt)
        kw, vw = kc.clone(), vc.clone()
        q = qw = q_got = q_want = None
        if ly == 1 and k % 3:  # the block's call: its q heads (more than the kv heads, or fewer) in the same launch
            qh = pick((1, 2 * hh, 3))
            q = rnd(bq * n, qh * e + 5, dtype=dt, scale=2)[:, :qh * e].view(bq * n, qh, e)
            qw = rnd(e, dtype=dt)
            q_got, q_want = torch.empty_like(q), torch.empty_like(q)
        kv_norm_rope_store_triton(kv, kn, 1e-6, cos, sin, interleave, pos, kc, vc, q, qw, q_got)
        kv_norm_rope_store_reference(kv, kn, 1e-6, cos, sin, interleave, pos, kw, vw, q, qw, q_want)
        err = float((kc.float() - kw.float()).abs().max() / kw.float().abs().max().clamp_min(1e-30))
        if q is not None:
            err = max(err, float((q_got.float() - q_want.float()).abs().max() / q_want.float().abs().max()))
        ok = bool(torch.isfinite(kc.float()).all()) and err <= 2 * ULP[dt] and torch.equal(vc, vw)
        out.append(dict(op="kv_norm_rope_store", case=f"L{ly} b{bq} n{n} cap{cap} h{hh} e{e} {dt} il={interleave} "
                        f"q={q is not None}", ok=ok, err=err))

        # drafter_block: positions, block tokens and visible lengths; lens advanced (integers: exact)
        bq, a, s = pick((1, 2, 4)), pick((1, 3, 9)), pick((2, 8))
        lens = torch.randint(0, 100, (bq,), generator=g, dtype=torch.int32).to(device)
        ctx_len = torch.randint(0, a + 1, (bq,), generator=g, dtype=torch.int32).to(device)
        bonus = torch.randint(0, 1000, (bq,), generator=g).to(device)
        got = [torch.full(shape, -7, dtype=torch.int64, device=device) for shape in ((bq, a), (bq, s), (bq, s), (bq,))]
        want = [x.clone() for x in got]
        lens_w = lens.clone()
        drafter_block_triton(lens, ctx_len, bonus, 999, *got)
        drafter_block_reference(lens_w, ctx_len, bonus, 999, *want)
        ok = torch.equal(lens, lens_w) and all(torch.equal(x, y) for x, y in zip(got, want))
        out.append(dict(op="drafter_block", case=f"b{bq} a{a} s{s}", ok=ok, err=0.0))

        # embed_range: a rank's vocabulary range (ids below, inside and past it; rows past count are padding)
        v, dd, start = pick((7, 64)), pick((16, 300)), pick((0, 5, 40))
        count = v - pick((0, 2))
        weight = rnd(v, dd, dtype=dt)
        toks = torch.randint(0, start + v + 10, (pick((1, 3)), pick((1, 6))), generator=g).to(device)
        got = torch.empty(toks.numel(), dd, dtype=dt, device=device)
        embed_range_triton(toks.reshape(-1), weight, start, count, got)
        want = embed_range_reference(toks, weight, start, count).reshape(-1, dd)
        out.append(dict(op="embed_range", case=f"v{v} count{count} start{start} d{dd} {dt}", ok=torch.equal(got, want),
                        err=0.0))

        # embed_norm_rope: the embedding rows exactly (ids outside the range: zero rows), their norm as rms_norm's,
        # cos / sin as rope_cos_sin's (int32 or int64 positions, the AR step's are the cache lengths)
        if dt != torch.bfloat16 or device == "cuda":
            dd, r2 = pick((16, 300, 7168)), pick((32, 3))
            weight, nw = rnd(v, dd, dtype=dt, scale=2), rnd(dd, dtype=dt)
            toks = torch.randint(0, start + v + 10, (pick((1, 3)), pick((1, 6))), generator=g).to(device)
            pos = torch.randint(0, 1 << 18, toks.shape, generator=g).to(device=device, dtype=pick((torch.int32,
                                                                                                  torch.int64)))
            inv = (1.0 / (10000.0 ** (torch.arange(r2, dtype=torch.float32) / r2))).to(device)
            n_tok = toks.numel()
            got = [torch.empty(n_tok, dd, dtype=dt, device=device) for _ in range(2)] + \
                [torch.empty(n_tok, r2, dtype=dt, device=device) for _ in range(2)]
            embed_norm_rope_triton(toks.reshape(-1), weight, start, count, nw, 1e-6, pos.reshape(-1), inv, 1.25, *got)
            want = [w.reshape(n_tok, -1) for w in embed_norm_rope_reference(toks, weight, start, count, nw, 1e-6, pos,
                                                                           inv, 1.25)]
            (ok_h, err_h), exact = _close(got[1], want[1], exact=False), device == "cuda"
            (ok_c, err_c), (ok_s, err_s) = _close(got[2], want[2], exact), _close(got[3], want[3], exact)
            out.append(dict(op="embed_norm_rope", case=f"v{v} count{count} start{start} d{dd} r{2 * r2} {dt}",
                            ok=torch.equal(got[0], want[0]) and ok_h and ok_c and ok_s, err=max(err_h, err_c, err_s)))

        # odd cases: gate_up is an fp32 GEMM output (the router's GEMM, runtime/model/moe), rounded to dt first
        i = pick((5, 256, 2304))
        wide_in = k % 2 == 1
        gu = rnd(t, 2 * i + 3, dtype=torch.float32 if wide_in else dt, scale=3)[:, :2 * i]
        got = torch.empty(t, i, dtype=dt, device=device)
        silu_mul_triton(gu, got)
        # bit-identical to CUDA torch (the same IEEE exp and division); the CPU reference's vectorised exp
        # may differ in the last fp32 bit, which rounding to 16 bits hides almost always
        want = silu_mul_reference(gu, dt if wide_in else None)
        ok, err = _close(got, want, exact=device == "cuda" and dt != torch.float32)
        out.append(dict(op="silu_mul", case=f"t{t} i{i} {dt} from {gu.dtype}", ok=ok and got.dtype == want.dtype,
                        err=err))
    return out


@pytest.fixture(scope="module")
def interpreter_results():
    return interpreted(__file__)


@pytest.mark.parametrize("op", ["add_rms_norm", "rms_norm", "rope_cos_sin", "mla_q_absorb", "mla_v_absorb",
                                "mla_rope_kv", "silu_mul", "kv_norm_rope_store",
                                "drafter_block", "embed_range", "embed_norm_rope"])
def test_kernel_matches_reference_in_interpreter(interpreter_results, op):
    cases = [c for c in interpreter_results if c["op"] == op]
    assert cases and all(c["ok"] for c in cases), [c for c in cases if not c["ok"]]


def test_cpu_ops_are_the_references():
    """On CPU (and for fp64) the public functions are the references: the layer computes what it did."""
    from plugins.layer_fusion import (
        add_rms_norm,
        mla_q_absorb,
        mla_rope_kv,
        mla_v_absorb,
        rms_norm,
        silu_mul,
    )
    g = torch.Generator().manual_seed(3)
    x, d, w = torch.randn(2, 5, 16, generator=g), torch.randn(2, 5, 16, generator=g), torch.randn(16, generator=g)
    assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))
    s, y = add_rms_norm(x.double(), d.double(), w.double(), 1e-6)
    ws, wy = add_rms_norm_reference(x.double(), d.double(), None, w.double(), 1e-6)
    assert torch.equal(s, ws) and torch.equal(y, wy) and s.dtype == torch.float64
    q, w_uk, cs = torch.randn(4, 2, 10, generator=g), torch.randn(2, 6, 5, generator=g), torch.randn(4, 2, generator=g)
    assert torch.equal(mla_q_absorb(q, w_uk, cs, cs, True), mla_q_absorb_reference(q, w_uk, cs, cs, True))
    o_lat, w_uv = torch.randn(2, 4, 6, generator=g).transpose(0, 1), torch.randn(2, 3, 6, generator=g)
    assert torch.equal(mla_v_absorb(o_lat, w_uv), mla_v_absorb_reference(o_lat, w_uv))
    got, want = torch.zeros(2, 2, 10), torch.zeros(2, 2, 10)
    ql, qw, q_out = torch.randn(4, 12, generator=g), torch.randn(12, generator=g), torch.zeros(4, 12)
    mla_rope_kv(torch.randn(4, 10, generator=g), torch.randn(6, generator=g), 1e-6, cs, cs, False, got, ql, qw, q_out)
    assert torch.count_nonzero(got) > 0 and not torch.equal(got, want)
    assert torch.equal(q_out, rms_norm_reference(ql, qw, 1e-6))
    with pytest.raises(ValueError, match="come together"):
        mla_rope_kv(torch.randn(4, 10), torch.randn(6), 1e-6, cs, cs, False, got, ql, None, q_out)
    gu = torch.randn(3, 8, generator=g)
    assert torch.equal(silu_mul(gu), silu_mul_reference(gu))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernels_on_gpu_many_cases():
    cases = run_cases("cuda", gpu_cases(240), seed=11)
    bad = [c for c in cases if not c["ok"]]
    results = os.environ.get("KDTREE_RESULTS_DIR")
    if results:
        Path(results).mkdir(parents=True, exist_ok=True)
        (Path(results) / "layer_fusion_cases.json").write_text(json.dumps(
            {"cases": len(cases), "failed": bad[:20], "max_err": {op: max(c["err"] for c in cases if c["op"] == op)
                                                                  for op in {c["op"] for c in cases}}}, indent=1))
    assert not bad, bad[:10]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_ops_dispatch_to_kernels_on_gpu():
    """The registered ops on CUDA tensors run the kernels (fp64 the reference) and agree with the CPU path."""
    from plugins.layer_fusion import add_rms_norm, mla_q_absorb, mla_v_absorb, silu_mul
    g = torch.Generator().manual_seed(2)
    x, d, w = torch.randn(3, 4, 7168, generator=g), torch.randn(3, 4, 7168, generator=g), torch.randn(7168, generator=g)
    for dt in (torch.bfloat16, torch.float64):
        s, y = add_rms_norm(x.to("cuda", dt), d.to("cuda", dt), w.to("cuda", dt), 1e-6)
        ws, wy = add_rms_norm_reference(x.to(dt), d.to(dt), None, w.to(dt), 1e-6)
        assert torch.equal(s.cpu(), ws) and _close(y.cpu(), wy, exact=False)[0]
    q, w_uk, cs = torch.randn(5, 8, 192, generator=g), torch.randn(8, 128, 512, generator=g) * 0.1, \
        torch.randn(5, 32, generator=g)
    got = mla_q_absorb(*(v.to("cuda", torch.bfloat16) for v in (q, w_uk, cs, cs)), True).cpu()
    want = mla_q_absorb_reference(*(v.to(torch.bfloat16) for v in (q, w_uk, cs, cs)), True)
    bound = torch.bmm(q[..., :128].transpose(0, 1).abs(), w_uk.abs()).transpose(0, 1)  # [5, 8, 512] fp32
    assert torch.equal(got[..., 512:], want[..., 512:])
    assert ((got[..., :512].float() - want[..., :512].float()).abs() <= 4 * ULP[torch.bfloat16] * bound).all()
    o_lat, w_uv = torch.randn(5, 8, 512, generator=g), torch.randn(8, 128, 512, generator=g) * 0.1
    got = mla_v_absorb(*(v.to("cuda", torch.bfloat16) for v in (o_lat, w_uv))).cpu()
    want = mla_v_absorb_reference(*(v.to(torch.bfloat16) for v in (o_lat, w_uv)))
    bound = torch.bmm(o_lat.transpose(0, 1).abs(), w_uv.abs().transpose(1, 2)).transpose(0, 1)  # [5, 8, 128] fp32
    assert ((got.float() - want.float()).abs() <= 4 * ULP[torch.bfloat16] * bound).all()
    gu = torch.randn(6, 512, generator=g).to(torch.bfloat16)
    assert torch.equal(silu_mul(gu.cuda()).cpu(), silu_mul_reference(gu))


if __name__ == "__main__" and "--interpreter" in sys.argv:
    print(json.dumps(run_cases("cpu", 6)))
