"""moe_w4a16 v3's fragment layout (plugins/moe_w4a16/fragment_layout.py): exact round trips, and a CPU model
of what moe_v3.cu does with it, lane by lane, following PTX's m16n8k16 fragment definitions: A register r
of lane (g, u) holds rows g + 8 (r % 2), logical k 2u + 8 (r // 2) + (0, 1); B register b holds logical
k 2u + 8 b + (0, 1) of token column g; C element r is row g + 8 (r // 2), column 2u + r % 2.  If the layout
and the kernel's reading of it disagree, this model's product differs from the dense one."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch

from plugins.moe_w4a16.fragment_layout import (
    dequantize_fragments,
    from_fragments,
    planar_to_fragments,
    to_fragments,
)
from plugins.moe_w4a16.layout import pack_experts


def _draw(e, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (e, n, k), generator=g, dtype=torch.int8)
    s = (torch.rand(e, n, k // 32, generator=g) + 0.5).to(torch.bfloat16)
    return q, s


@pytest.mark.parametrize("gate_up,n,k", [(True, 64, 96), (False, 64, 256), (True, 128, 7168 // 4), (False, 32, 32)])
def test_round_trip_is_exact(gate_up, n, k):
    q, s = _draw(2, n, k, n + k)
    packed, scale = to_fragments(q, s, gate_up)
    kp = -(-k // 256) * 256
    assert packed.shape == (2, n // 32, kp // 32, 32, 4) and scale.shape == (2, n // 32, kp // 32, 8, 4)
    q2, s2 = from_fragments(packed, scale, k, gate_up)
    assert torch.equal(q2, q) and torch.equal(s2, s)
    dense = (q.float().unflatten(-1, (-1, 32)) * s.float().unsqueeze(-1)).flatten(-2)
    assert torch.equal(dequantize_fragments(packed, scale, k, gate_up), dense)
    pp, ps = planar_to_fragments(*pack_experts(q, s), k, gate_up)  # from the v2 (planar) kernel layout
    assert torch.equal(pp, packed) and torch.equal(ps, scale)


def test_rejects_rows_not_in_pairs():
    q, s = _draw(1, 48, 64, 0)
    with pytest.raises(ValueError, match="32-row pairs"):
        to_fragments(q, s, False)
    with pytest.raises(ValueError, match="i % 16"):
        to_fragments(*_draw(1, 40, 64, 1), True)


def _lane_model(packed: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """One expert, one row pair, all groups: the kernel's per-lane arithmetic -> C [2 tiles, 16 rows, 8 tokens].
    packed [C, 32, 4] int32, scale [C, 8, 4], x [8, kp] (token rows)."""
    n_groups = packed.shape[0]
    acc = torch.zeros(2, 16, 8, dtype=torch.float64)
    for c in range(n_groups):
        part = torch.zeros(2, 16, 8, dtype=torch.float64)
        for st in range(2):
            for m in range(2):
                a = torch.zeros(16, 16, dtype=torch.float64)  # A [rows, logical k]
                bmat = torch.zeros(16, 8, dtype=torch.float64)  # B [logical k, token]
                for lane in range(32):
                    g, u = lane // 4, lane % 4
                    w = int(packed[c, lane, 2 * m + st]) & 0xFFFFFFFF
                    for r in range(4):
                        lo, hi = ((w >> (4 * r)) & 0xF) - 8, ((w >> (4 * r + 16)) & 0xF) - 8
                        row, col = g + 8 * (r % 2), 2 * u + 8 * (r // 2)
                        a[row, col], a[row, col + 1] = lo, hi
                    xv = x[g, 32 * c + 8 * u: 32 * c + 8 * u + 8].double()  # the lane's 16-byte token vector
                    for b in range(2):
                        bmat[2 * u + 8 * b, g], bmat[2 * u + 8 * b + 1, g] = xv[4 * st + 2 * b], xv[4 * st + 2 * b + 1]
                part[m] += a @ bmat
        for lane in range(32):  # the lane's scales: (tile 0 row g, tile 0 row g+8, tile 1 row g, tile 1 row g+8)
            g = lane // 4
            sv = scale[c, g].double()
            for m in range(2):
                acc[m, g] += sv[2 * m] * part[m, g] / 4  # each of the 4 lanes of row g adds a quarter: same sum
                acc[m, g + 8] += sv[2 * m + 1] * part[m, g + 8] / 4
    return acc


@pytest.mark.parametrize("gate_up", [True, False])
def test_lane_model_matches_dense(gate_up):
    n, k = 64, 64
    q, s = _draw(1, n, k, 7 + gate_up)
    packed, scale = to_fragments(q, s, gate_up)
    x = torch.randn(8, 256, dtype=torch.float64)
    x[:, k:] = 0.0  # the kernel loads no token values past k (c < c_real)
    dense = (q.double().unflatten(-1, (-1, 32)) * s.double().unsqueeze(-1)).flatten(-2)[0]  # [n, k]
    for p in range(n // 32):
        got = _lane_model(packed[0, p], scale[0, p], x)  # [2, 16, 8]
        if gate_up:  # pair p = gate rows 16p.. and up rows i + 16p..
            rows = [torch.arange(16 * p, 16 * p + 16), torch.arange(n // 2 + 16 * p, n // 2 + 16 * p + 16)]
        else:
            rows = [torch.arange(32 * p, 32 * p + 16), torch.arange(32 * p + 16, 32 * p + 32)]
        for m in range(2):
            want = dense[rows[m]] @ x[:, :k].T  # [16, 8]
            assert torch.allclose(got[m], want, rtol=1e-12, atol=1e-9), (p, m)


def test_zero_and_padding_are_nibble_8():
    """Stored nibbles are q + 8 (the checkpoint's convention): a zero weight, and the k padding, are nibble 8."""
    packed, scale = to_fragments(torch.zeros(1, 32, 32, dtype=torch.int8), torch.ones(1, 32, 1), False)
    assert packed.shape == (1, 1, 8, 32, 4)  # k 32 padded to 256
    assert bool((packed == 0x88888888 - 2**32).all())
    assert bool((scale[:, :, 1:] == 0).all()) and bool((scale[:, :, 0] == 1).all())


def test_cpu_op_reads_both_layouts_alike():
    """The op's CPU path (the reference) gives the same y for the same experts in fragment order (what the build
    writes) and planar (artifacts built before)."""
    from plugins.moe_w4a16 import (
        MoEWorkspace,
        moe_w4a16,
        pack_int4_experts,
        planar_copy,
    )
    e, d, i, t = 6, 64, 64, 5
    q13, s13 = _draw(e, 2 * i, d, 1)
    q2, s2 = _draw(e, d, i, 2)
    frag = pack_int4_experts(q13, s13, q2, s2)
    planar = tuple(a for pair in (pack_experts(q13, s13), pack_experts(q2, s2)) for a in pair)
    assert frag[0].dim() == 5 and all(torch.equal(a, b) for a, b in zip(planar_copy(*frag, d), planar))
    x = torch.randn(t, d).to(torch.bfloat16)
    logits, bias = torch.randn(t, e), torch.zeros(e)
    ws = MoEWorkspace.allocate(t, 2, e, d, i, x.dtype, "cpu").buffer
    y_frag = moe_w4a16(x, logits, None, bias, *frag, 2, 1, 1, True, 1.5, 0, ws)
    assert torch.equal(y_frag, moe_w4a16(x, logits, None, bias, *planar, 2, 1, 1, True, 1.5))


def test_artifact_cubin_is_found_first_and_checked(tmp_path):
    """A loaded artifact's CUDA C cubins (kdtree build compiles plugins/**/*.cu) are where plugins/common/cubin.py
    looks first, after their sha256 is checked against the manifest; a corrupted one is refused by name, and one built
    from another version of its source is left out with a warning (its kernels may take other arguments)."""
    import hashlib

    from core.errors import CheckpointError
    from plugins.common import cubin as cubin_mod
    from plugins.moe_w4a16.launch_v3 import SOURCE
    from runtime.load.kernel_cache import KernelCacheWarning, register_cuda_kernels

    art = tmp_path / "art"
    rel = "kernels/sm_90/moe_w4a16/moe_v3.cubin"
    (art / rel).parent.mkdir(parents=True)
    body = b"\x7fELF not really a cubin"
    (art / rel).write_bytes(body)
    record = {"kind": "cuda", "op": "moe_w4a16", "name": "moe_v3", "arch": "sm_90", "cubin": rel,
              "source_sha256": cubin_mod.source_sha256(SOURCE)}
    files = {rel: {"sha256": hashlib.sha256(body).hexdigest(), "bytes": len(body)}}
    saved = dict(cubin_mod._BUILT)
    try:
        cubin_mod._BUILT.clear()
        # built from another version of moe_v3.cu (or before builds recorded it): left out, named, compiled at use
        for other in ({**record, "source_sha256": "0" * 64}, {k: v for k, v in record.items() if k != "source_sha256"}):
            with pytest.warns(KernelCacheWarning, match="moe_v3.cubin: built from another version"):
                assert register_cuda_kernels(art, {"kernels": [other], "files": files}) == []
            assert not cubin_mod._BUILT
        manifest = {"kernels": [record], "files": files}
        assert register_cuda_kernels(art, manifest) == [rel]
        data, where = cubin_mod.cubin(SOURCE, "sm_90", tmp_path / "cache")
        assert data == body and where == str(art / rel)  # nothing compiled, the cache untouched
        assert not (tmp_path / "cache").exists()
        (art / rel).write_bytes(b"\x7fELF tampered")
        with pytest.raises(CheckpointError, match="moe_v3.cubin"):
            register_cuda_kernels(art, manifest)
        assert register_cuda_kernels(art, {"kernels": [], "files": {}}) == []  # none: the runtime compiles
    finally:
        cubin_mod._BUILT.clear()
        cubin_mod._BUILT.update(saved)


@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="nvcc not on PATH")
def test_every_variant_the_launcher_picks_is_compiled(tmp_path):
    """moe_v3.cu compiles (for sm_90 and sm_120: mma.sync only) and holds every kernel launch_v3 can name."""
    from plugins.common.cubin import _nvcc, source_text
    from plugins.moe_w4a16.launch_v3 import (
        DOWN_P,
        GATE_UP_P,
        SOURCE,
        WARPS,
        gate_up_variant,
        gate_up_w16,
    )

    names = {f"kdtree_moe_v3_down{early}_nt{nt}_p{p}" for nt, p in DOWN_P.items() for early in ("", "_early")}
    for nt in GATE_UP_P:
        for per_warp in range(1, 40):
            names.add(gate_up_variant(nt, per_warp * WARPS))
            names.add(gate_up_w16(nt, per_warp * WARPS, 100, 132))
    names.discard(None)
    names.add("kdtree_moe_v3_one")  # gate_up and down of one token in one grid (launch_v3.ONE_LAUNCH)
    assert "kdtree_moe_v3_gate_up_w16_nt1_p7" in names
    for arch in ("sm_90", "sm_120"):
        data = _nvcc(source_text(SOURCE), SOURCE.name, arch)  # the text NVRTC compiles (its header inlined)
        assert data[:4] == b"\x7fELF"
        missing = sorted(n for n in names if n.encode() not in data)
        assert not missing, (arch, missing)
    # programmatic dependent launch: every kernel waits for its predecessor grid before reading anything
    ptx = tmp_path / "moe_v3.ptx"
    subprocess.run([shutil.which("nvcc"), "-ptx", "-arch=sm_90", "-std=c++17", "-o", str(ptx), str(SOURCE)], check=True)
    bodies = ptx.read_text().split(".entry ")[1:]
    assert len(bodies) >= len(names) and all("griddepcontrol.wait" in b for b in bodies)
    # gate_up and the late down wait first; down_early reads only the route kernel's outputs (through L2) and
    # prefetches its first weights before the wait, and its h loads go through L2, never .nc (which ptxas may hoist
    # above the wait: tests/test_pdl_order_sass.py checks the SASS)
    for b in bodies:
        name = b.split("(")[0]
        if "gate_up" in name or ("_down_" in name and "_early_" not in name):
            assert b.find("griddepcontrol.wait") < min(b.find(op) for op in ("ld.global", "ld.volatile") if op in b)
        if "_down_" in name:
            assert "ld.global.nc.v4.u32" not in b and "ld.global.cg.v4.u32" in b, name
        if name == "kdtree_moe_v3_one":  # waits first; h rows through L2 after the acquire of the pick's counter
            assert b.find("griddepcontrol.wait") < min(m.start() for m in re.finditer(r"ld\.global", b)), name
            assert b.find("ld.acquire.gpu") < b.rfind("ld.global.cg.v4.u32"), name
        if "_down_early_" in name:
            wait = b.find("griddepcontrol.wait")
            assert -1 < b.find("cp.async.bulk.prefetch.L2.global") < wait, name
            assert all(m.start() > wait for m in re.finditer(r"ld\.global\.nc\.L1::no_allocate", b)), name
    # and every expert GEMM but the one-token grid (its down weights go to shared memory by cp.async) can put its
    # weights in flight with the bulk L2 prefetch (taken when pf is set)
    assert all("cp.async.bulk.prefetch.L2.global" in b for b in bodies if not b.startswith("kdtree_moe_v3_one"))


def test_token_tiles_follow_the_measured_choice():
    """launch_v3.token_tile: NT = 1 to a 16-node tree's 17 tokens, 2 beyond (the H200 measurements in its doc: NT = 4
    lost at 64 and 512 tokens); down takes at most 2."""
    from plugins.moe_w4a16.launch_v3 import down_tile, token_tile
    assert [token_tile(t) for t in (1, 8, 9, 17, 18, 33, 64, 65, 512, 4096)] == [1, 1, 1, 1, 2, 2, 2, 2, 2, 2]
    assert [down_tile(nt) for nt in (1, 2, 4)] == [1, 2, 2]


def test_the_16_warp_gate_up_takes_one_token_at_k26_only(monkeypatch):
    """launch_v3.gate_up_w16: at t = 1 on the K2.6 TP8 rank (224 k groups, at most 9 x 16 items on 132 SMs) one
    16-warp CTA per SM; not at t = 2 (288 items), not for k groups 16 warps x 7 do not divide (the tiny models).
    launch_v3.gate_up_kernel (the launch's choice) takes it there with USE_W16 (on by default since 2026-12-06's
    measurement), else the 8-warp kernel with the deepest ring."""
    from plugins.moe_w4a16 import launch_v3
    from plugins.moe_w4a16.launch_v3 import gate_up_kernel, gate_up_w16, max_entries, token_tile
    items = lambda t: max_entries(t, 8, 384, token_tile(t)) * 16  # noqa: E731
    assert gate_up_w16(token_tile(1), 224, items(1), 132) == "kdtree_moe_v3_gate_up_w16_nt1_p7"
    assert gate_up_w16(token_tile(2), 224, items(2), 132) is None
    assert gate_up_w16(1, 8, 16, 132) is None and gate_up_w16(2, 224, 100, 132) is None
    assert launch_v3.USE_W16  # the default: the 16-warp gate_up where it applies
    monkeypatch.setattr(launch_v3, "USE_W16", False)
    assert gate_up_kernel(token_tile(1), 224, items(1), 132) == ("kdtree_moe_v3_gate_up_nt1_p7", 8)
    monkeypatch.setattr(launch_v3, "USE_W16", True)
    assert gate_up_kernel(token_tile(1), 224, items(1), 132) == ("kdtree_moe_v3_gate_up_w16_nt1_p7", 16)
    assert gate_up_kernel(token_tile(17), 224, items(17), 132) == ("kdtree_moe_v3_gate_up_nt1_p7", 8)
    assert gate_up_kernel(token_tile(64), 224, items(64), 132) == ("kdtree_moe_v3_gate_up_nt2_p4", 8)
    assert gate_up_kernel(1, 8, 16, 132) == ("kdtree_moe_v3_gate_up_nt1_p1", 8)


def test_v3_inputs_are_checked_by_name():
    """launch_v3 refuses inputs whose shapes the kernels would read past, naming the tensor (checked on CPU
    tensors: the check runs before anything touches the GPU)."""
    from plugins.moe_w4a16 import pack_int4_experts
    from plugins.moe_w4a16.launch_v3 import check_fragments
    e, d, i, t = 4, 64, 64, 3
    q13, s13 = _draw(e, 2 * i, d, 5)
    q2, s2 = _draw(e, d, i, 6)
    w13, sc13, w2, sc2 = pack_int4_experts(q13, s13, q2, s2)
    x, logits, bias = torch.randn(t, d).to(torch.bfloat16), torch.randn(t, e), torch.zeros(e)
    check_fragments(x, logits, bias, w13, sc13, w2, sc2, 2, 0)  # fits
    with pytest.raises(ValueError, match="w2_scale must be"):
        check_fragments(x, logits, bias, w13, sc13, w2, sc2.float(), 2, 0)
    with pytest.raises(ValueError, match="w2 must be"):
        check_fragments(x, logits, bias, w13, sc13, w2[:, :1], sc2, 2, 0)
    with pytest.raises(ValueError, match="x must be bf16"):
        check_fragments(x.float(), logits, bias, w13, sc13, w2, sc2, 2, 0)
    with pytest.raises(ValueError, match="logits must be fp32"):
        check_fragments(x, logits[:2], bias, w13, sc13, w2, sc2, 2, 0)
    with pytest.raises(ValueError, match="outside"):
        check_fragments(x, torch.randn(t, e + 4), torch.zeros(e + 4), w13, sc13, w2, sc2, 2, 6)


def test_loader_serves_v2c_where_v3_does_not():
    """runtime/load/artifact: fragment-order experts stay as stored where v3 serves; other dtypes get the planar
    copy silently, a GPU without v3 kernels gets it with one MoEKernelWarning naming why."""
    import warnings

    from plugins.moe_w4a16 import pack_int4_experts, planar_copy
    from runtime.load.artifact import MoEKernelWarning, serving_form, v3_problem
    e, d, i = 3, 64, 32
    q13, s13 = _draw(e, 2 * i, d, 8)
    q2, s2 = _draw(e, d, i, 9)
    frag = pack_int4_experts(q13, s13, q2, s2)
    planar = planar_copy(*frag, d)
    why = v3_problem(torch.device("cpu"), torch.float32, torch.bfloat16)  # decided before any GPU is asked
    assert why == "torch.float32 tokens with torch.bfloat16 scales"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for the expected cases
        assert all(a is b for a, b in zip(serving_form(*frag, d, None), frag))
        got = serving_form(*frag, d, why)
    assert all(torch.equal(a, b) for a, b in zip(got, planar)) and got[0].dim() == 3
    with pytest.warns(MoEKernelWarning, match="unavailable: CubinUnavailable: moe_v3.cu for sm_90"):
        got = serving_form(*frag, d, "unavailable: CubinUnavailable: moe_v3.cu for sm_90: nvcc: not on PATH")
    assert all(torch.equal(a, b) for a, b in zip(got, planar))


def test_prefetch_variable_names_the_kernels(monkeypatch):
    """KDTREE_MOE_PREFETCH: unset / 0 neither kernel's L2 prefetch, 1 both; anything else is a ValueError naming the
    variable."""
    from plugins.moe_w4a16.launch_v3 import PREFETCH_ENV, prefetch_on
    want = {None: False, "0": False, "1": True}
    for value, on in want.items():
        if value is None:
            monkeypatch.delenv(PREFETCH_ENV, raising=False)
        else:
            monkeypatch.setenv(PREFETCH_ENV, value)
        assert prefetch_on() is on, value
    for bad in ("on", "down"):
        monkeypatch.setenv(PREFETCH_ENV, bad)
        with pytest.raises(ValueError, match=PREFETCH_ENV):
            prefetch_on()


def test_one_launch_takes_one_token_on_hopper_only(monkeypatch):
    """launch_v3.one_launch_applies: on by default (ONE_LAUNCH), the K2.6 TP8 rank's t = 1
    (8 picks x 16 row pairs = 128 CTAs, 224 k groups, 224 down row pairs over 16 warps x 16 CTAs) on a 132-SM sm_90
    GPU; not a second token, not fewer SMs than CTAs (114: every CTA must be resident at once), not sm_120, not the
    EP8 rank's whole experts (1024 CTAs), not k groups 16 x 7 do not divide (the tiny models), not under MPS with an
    SM share; off (KDTREE_MOE_ONE_LAUNCH=0), never."""
    from plugins.common.device import facts_for
    from plugins.moe_w4a16 import launch_v3
    from plugins.moe_w4a16.launch_v3 import one_launch_applies, one_smem
    h200, h100_pcie, blackwell = facts_for(132, (9, 0)), facts_for(114, (9, 0)), facts_for(188, (12, 0))
    k26 = (8, 16, 224, 224, 8)  # top_k, w13 row pairs, k groups, w2 row pairs, k groups (i = 256 padded)
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
    assert launch_v3.ONE_LAUNCH and one_launch_applies(1, *k26, h200)
    for share, taken in (("50", False), ("100", True), ("x", False)):
        monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", share)
        assert one_launch_applies(1, *k26, h200) == taken, share
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    monkeypatch.setattr(launch_v3, "ONE_LAUNCH", False)
    assert not one_launch_applies(1, *k26, h200)
    monkeypatch.setattr(launch_v3, "ONE_LAUNCH", True)
    assert not one_launch_applies(2, *k26, h200)
    assert not one_launch_applies(1, *k26, h100_pcie) and not one_launch_applies(1, *k26, blackwell)
    assert not one_launch_applies(1, 8, 128, 224, 224, 64, h200)  # EP8: i = 2048
    assert not one_launch_applies(1, 2, 4, 8, 8, 8, h200)  # d = 256: 8 k groups
    assert not one_launch_applies(1, 8, 8, 224, 224, 8, h200)  # i = 128 at d = 7168: 224 down row pairs > 16 x 8
    assert one_smem(8) == 16 * 256 * 4 + 256 + 16 * 8 * 32 * 2 + 16 * 8 * 32 * 24 <= 227 * 1024


def test_one_launch_shared_rows_cover_d_once():
    """kdtree_moe_v3_one's shared-expert rows (ONE_SHARED) with the combine (ONE_COMBINE): CTA (k, p) takes slice k
    (launch_v3.one_shared_rows rows) of the rows of the down row pairs p, p + pairs13, ... (moe_v3.cu's one_group_row),
    the pairs its warps and the combine's last CTA of p take; over the grid every row of d once, for K2.6 TP8 (56 rows
    a CTA) and ragged shapes.  Without the combine, d in ranges over the grid."""
    import torch
    from plugins.moe_w4a16.launch_v3 import one_shared_rows
    for top_k, pairs13, pairs2, i_s in ((8, 16, 224, 256), (2, 8, 112, 64), (8, 8, 112, 128), (6, 5, 23, 64)):
        d = 32 * pairs2
        x = torch.zeros(1, d, dtype=torch.bfloat16)
        h, down = torch.zeros(1, i_s, dtype=torch.bfloat16), torch.zeros(d, i_s, dtype=torch.bfloat16)
        rows = one_shared_rows(top_k, pairs13, pairs2, 8, x, h, down, by_pair=True)
        assert rows > 0
        plain = one_shared_rows(top_k, pairs13, pairs2, 8, x, h, down)  # without the combine: d over the grid
        assert plain * top_k * pairs13 >= d > (plain - 1) * top_k * pairs13
        seen = []
        for k in range(top_k):
            for p in range(pairs13):
                m_p = -(-(pairs2 - p) // pairs13) if p < pairs2 else 0
                n_sd = max(0, min(rows, 32 * m_p - k * rows))
                seen += [32 * (p + pairs13 * (r // 32)) + r % 32 for r in range(k * rows, k * rows + n_sd)]
        assert sorted(seen) == list(range(d)), (top_k, pairs13, pairs2)
    k26 = (torch.zeros(1, 7168, dtype=torch.bfloat16), torch.zeros(1, 256, dtype=torch.bfloat16),
           torch.zeros(7168, 256, dtype=torch.bfloat16))
    assert one_shared_rows(8, 16, 224, 8, *k26) == one_shared_rows(8, 16, 224, 8, *k26, by_pair=True) == 56
