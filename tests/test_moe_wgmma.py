"""moe_wgmma.cu (moe_w4a16's expert GEMMs on wgmma where experts see many tokens) on the CPU: a model of how its
B tiles are written (put_piece: a 16-byte piece of a token row, its four words to the fragment layout's k steps,
128-byte swizzle) and read (wgmma's K-major B at the k step's 32-byte offset), against the weights' A registers as
tests/test_moe_v3_layout.py models them: if the layout, put_piece and the descriptors' offsets disagree, the model's
product differs from the dense one.  Also: the source compiles for sm_90 (as sm_90a) and sm_120 with both kernels,
waits for its predecessor before any global load, reads h through L2; the launcher's shape rule and shared memory."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from plugins.moe_w4a16 import launch_wgmma
from plugins.moe_w4a16.fragment_layout import to_fragments


def _draw(e, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (e, n, k), generator=g, dtype=torch.int8)
    s = (torch.rand(e, n, k // 32, generator=g) + 0.5).to(torch.bfloat16)
    return q, s


def _put_piece(smem: torch.Tensor, block: int, row: int, v: int, piece: torch.Tensor) -> None:
    """moe_wgmma.cu's put_piece on a float64 model of shared memory indexed by 2-byte element: word j (two values) of
    the piece to chunk 4 (v / 4) + j (swizzled with row % 8), 4 (v % 4) bytes in."""
    for j in range(4):
        byte = block + row * 128 + (((4 * (v >> 2) + j) ^ (row & 7)) << 4) + 4 * (v & 3)
        smem[byte // 2], smem[byte // 2 + 1] = piece[2 * j], piece[2 * j + 1]


def _b_operand(smem: torch.Tensor, block: int, group: int, step: int, n: int) -> torch.Tensor:
    """What wgmma reads as B [16 k, n tokens] from the K-major, 128-byte swizzled tile whose descriptor starts at
    block + 64 group + 32 step: logical k of token row r at byte 64 group + 32 step + 2 k of the row, swizzled."""
    b = torch.zeros(16, n, dtype=torch.float64)
    for r in range(n):
        for k in range(16):
            off = 64 * group + 32 * step + 2 * k
            byte = block + r * 128 + (((off >> 4) ^ (r & 7)) << 4) + (off & 15)
            b[k, r] = smem[byte // 2]
    return b


def _a_operand(packed: torch.Tensor, scale: torch.Tensor, m: int, step: int) -> torch.Tensor:
    """The warp's A [16 rows, 16 logical k] of tile m, k step `step` of one group, as group_a forms it: A register r
    of lane (g, u) (PTX m16n8k16, also wgmma's register A per warp) holds rows g + 8 (r % 2), logical k 2u + 8 (r // 2)
    + (0, 1), from nibbles r, r + 4 of word 2 m + step, times the row's scale."""
    a = torch.zeros(16, 16, dtype=torch.float64)
    for lane in range(32):
        g, u = lane // 4, lane % 4
        w = int(packed[lane, 2 * m + step]) & 0xFFFFFFFF
        for r in range(4):
            row, col = g + 8 * (r % 2), 2 * u + 8 * (r // 2)
            sc = float(scale[g, 2 * m + r % 2])
            a[row, col] = (((w >> (4 * r)) & 0xF) - 8) * sc
            a[row, col + 1] = (((w >> (4 * r + 16)) & 0xF) - 8) * sc
    return a


@pytest.mark.parametrize("gate_up", [True, False])
def test_b_tiles_meet_the_fragment_layout(gate_up):
    """One row pair over a 128-k row (two 64-k blocks, four groups), 24 tokens: the sum over groups and k steps of
    A . B equals the dense product, for both tiles of the pair."""
    n, k, tokens = 64, 128, 24
    q, s = _draw(1, n, k, 11 + gate_up)
    packed, scale = to_fragments(q, s, gate_up)  # [1, pairs, groups, 32, 4], [1, pairs, groups, 8, 4]
    x = torch.randn(tokens, k, dtype=torch.float64)
    smem = torch.zeros(2 * 64 * 64, dtype=torch.float64)  # two blocks of 64 rows x 64 k
    for blk in range(k // 64):
        for r in range(tokens):
            for v in range(8):  # the 8 pieces of a row's 64 k
                _put_piece(smem, blk * 8192, r, v, x[r, 64 * blk + 8 * v: 64 * blk + 8 * v + 8])
    dense = (q.double().unflatten(-1, (-1, 32)) * s.double().unsqueeze(-1)).flatten(-2)[0]  # [n, k]
    for p in range(n // 32):
        got = torch.zeros(2, 16, tokens, dtype=torch.float64)
        for c in range(k // 32):
            for m in range(2):
                for st in range(2):
                    got[m] += _a_operand(packed[0, p, c], scale[0, p, c], m, st) @ _b_operand(
                        smem, (c // 2) * 8192, c % 2, st, tokens)
        if gate_up:  # pair p = gate rows 16p.. and up rows i + 16p..
            rows = [torch.arange(16 * p, 16 * p + 16), torch.arange(n // 2 + 16 * p, n // 2 + 16 * p + 16)]
        else:
            rows = [torch.arange(32 * p, 32 * p + 16), torch.arange(32 * p + 16, 32 * p + 32)]
        for m in range(2):
            assert torch.allclose(got[m], dense[rows[m]] @ x.T, rtol=1e-12, atol=1e-9), (p, m)


def test_shapes_the_kernels_take():
    """Whole blocks of 4 row pairs, k groups in fours, i's groups within the h tile (i <= 512): the K2.6 TP8 rank
    (pairs 16 / 224, groups 224 / 8) fits; EP8's whole experts (i = 2048) and the tiny models' odd pairs do not."""
    assert launch_wgmma.shapes_fit(16, 224, 224, 8)
    assert launch_wgmma.shapes_fit(4, 8, 8, 16)
    assert not launch_wgmma.shapes_fit(128, 224, 224, 64)  # EP8: i = 2048
    assert not launch_wgmma.shapes_fit(2, 8, 8, 8)  # i = 32: half a block of row pairs
    assert not launch_wgmma.shapes_fit(16, 224, 6, 8)  # d = 192: 6 pairs


def test_applies_only_where_asked_and_on_cuda(monkeypatch):
    """Off by default below MIN_TOKENS and when KDTREE_MOE_WGMMA is off; never on a CPU device (nothing loads)."""
    monkeypatch.setattr(launch_wgmma, "FORCE", None)
    monkeypatch.setattr(launch_wgmma, "ENABLED", True)
    assert not launch_wgmma.applies(launch_wgmma.MIN_TOKENS - 1, torch.device("cpu"), 16, 224, 224, 8)
    assert not launch_wgmma.applies(512, torch.device("cpu"), 16, 224, 224, 8)  # no CUDA device: nothing loads
    monkeypatch.setattr(launch_wgmma, "FORCE", True)
    assert not launch_wgmma.applies(512, torch.device("cpu"), 2, 8, 8, 8)  # shapes first


def test_shared_memory_fits_two_ctas_an_sm():
    """At K2.6 TP8 up to the op's 4096 tokens a call (launch_v3.MAX_TOKENS), both kernels' shared memory leaves two
    CTAs an SM on a Hopper SM (228 KB, 1 KB of it reserved per CTA)."""
    for t in (64, 512, 4096):
        assert 2 * (launch_wgmma.gate_up_smem(t, 8, 384) + 1024) <= 228 * 1024, t
        assert 2 * (launch_wgmma.down_smem(t, 8, 384, 8) + 1024) <= 228 * 1024, t
    assert launch_wgmma.down_smem(4096, 8, 384, 16) <= 227 * 1024  # i = 512: one CTA an SM at least


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_source_compiles_with_both_kernels(tmp_path):
    """sm_90 (compiled as sm_90a: wgmma; ptxas neither serialises the MMAs nor spills) and sm_120 (compiles, traps:
    the launcher never takes it there); in the PTX
    each kernel waits for its predecessor grid before any global load, and down's h loads go through L2 (.cg)."""
    from plugins.common.cubin import _nvcc, compile_arch, source_text
    src = launch_wgmma.SOURCE
    names = (b"kdtree_moe_wg_gate_up", b"kdtree_moe_wg_down")
    for arch in ("sm_90", "sm_120"):
        data = _nvcc(source_text(src), src.name, arch)
        assert data[:4] == b"\x7fELF" and all(n in data for n in names), arch
    # ptxas keeps the MMAs asynchronous (it says C7513 where it serialises them: with 3 or 4 register sets of A, one
    # group each, it did; plugins/moe_w4a16/NOTES.md) and spills nothing
    cubin = tmp_path / "moe_wgmma.cubin"
    done = subprocess.run([shutil.which("nvcc"), "-cubin", f"-arch={compile_arch(src.read_bytes(), 'sm_90')}",
                           "-std=c++17", "-Xptxas", "-v", "-o", str(cubin), str(src)], check=True, capture_output=True,
                          text=True)
    log = done.stdout + done.stderr
    assert "C751" not in log and "spill stores" in log
    assert all("0 bytes spill stores" in ln for ln in log.splitlines() if "spill stores" in ln)
    ptx = tmp_path / "moe_wgmma.ptx"
    subprocess.run([shutil.which("nvcc"), "-ptx", f"-arch={compile_arch(src.read_bytes(), 'sm_90')}", "-std=c++17",
                    "-o", str(ptx), str(src)], check=True)
    bodies = {b.split("(")[0].strip(): b for b in ptx.read_text().split(".entry ")[1:]}
    assert sorted(bodies) == sorted(n.decode() for n in names)
    for name, b in bodies.items():
        assert b.find("griddepcontrol.wait") < b.find("ld.global"), name
        assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in b, name
    assert "ld.global.cg.v4.u32" in bodies["kdtree_moe_wg_down"]
    assert "ld.global.nc.v4.u32" not in bodies["kdtree_moe_wg_down"]
