"""tree_verify_mla Triton kernel against the reference.

CPU: the kernel runs under TRITON_INTERPRET=1 in a subprocess (so the interpreter flag never leaks
into other test modules) on tiny shapes with reduced dims d_v 32 + d_r 16 and the real 512 + 64.
GPU (`-m gpu`): >= 200 random shapes, bf16 and fp32, random trees, poisoned outputs, plus a CUDA
graph capture; writes $KDTREE_RESULTS_DIR/tree_verify_mla-device-test.json when that is set.

Tolerances (‖out - ref‖ / ‖ref‖ against a reference in fp32 for bf16 inputs, fp64 for fp32 inputs):
fp32 inputs take exact fp32 dots: out 1e-5, |lse| 1e-5.  bf16 inputs: scores accumulate in fp32 but
p is rounded to bf16 for the value product and out is stored in bf16 (2^-9 relative): out 1e-2,
|lse| 2e-3.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gpu_cases import gpu_cases

from interpreter import interpreter_shims

from plugins.common.bitmask import causal_mask, pack_mask

ROOT = Path(__file__).resolve().parent.parent
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 2e-3)}  # (out rel, lse abs)


# ---------------------------------------------------------------- inputs shared by CPU and GPU checks

def random_tree_mask(b: int, n: int, gen: torch.Generator, kind: str = "tree") -> torch.Tensor:
    """[b, n, w] int64 ancestor mask: kind 'tree' (random parent < child), 'perm' (the same with
    nodes renumbered at random, so parents may come later) or 'chain'."""
    if kind == "chain":
        return causal_mask(b, n)
    anc = torch.zeros(b, n, n, dtype=torch.bool)  # [b, n, n]
    rows = torch.arange(b)
    for i in range(n):
        if i:
            anc[:, i] = anc[rows, torch.randint(0, i, (b,), generator=gen)]
        anc[:, i, i] = True
    if kind == "perm":
        for r in range(b):
            p = torch.randperm(n, generator=gen)  # old node i becomes node p[i]
            re = torch.zeros_like(anc[r])
            re[p[:, None], p[None, :]] = anc[r]
            anc[r] = re
    return pack_mask(anc)


def make_inputs(b: int, n: int, h: int, l_max: int, lens: list[int], d_v: int, d_r: int, dtype: torch.dtype,
                gen: torch.Generator, kind: str = "tree", device: str = "cpu") -> dict:
    """Fresh random inputs (drawn on the device, seeded from the CPU generator gen)."""
    d_qk = d_v + d_r
    dev_gen = torch.Generator(device=device).manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
    q = torch.randn(b, n, h, d_qk, generator=dev_gen, device=device)  # [b, n, h, d_qk]
    cache = torch.randn(b, l_max, d_qk, generator=dev_gen, device=device)  # [b, l_max, d_qk]
    tree_kv = torch.randn(b, n, d_qk, generator=dev_gen, device=device)  # [b, n, d_qk]
    scale = d_qk ** -0.5 * float(0.5 + 1.5 * torch.rand(1, generator=gen))
    return {"q": q.to(dtype), "cache": cache.to(dtype), "cache_lens": torch.tensor(lens, dtype=torch.int32,
            device=device), "tree_kv": tree_kv.to(dtype), "tree_mask": random_tree_mask(b, n, gen, kind).to(device),
            "scale": scale}


def reference(x: dict, d_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the reference in fp64 for fp32 inputs, fp32 for bf16 inputs (exact products)."""
    from plugins.tree_verify_mla.reference import tree_verify_mla_reference
    up = torch.float64 if x["q"].dtype == torch.float32 else torch.float32
    b, n, h, _ = x["q"].shape
    out = torch.empty(b, n, h, d_v, dtype=up, device=x["q"].device)
    lse = torch.empty(b, n, h, dtype=up, device=x["q"].device)
    tree_verify_mla_reference(x["q"].to(up), x["cache"].to(up), x["cache_lens"], x["tree_kv"].to(up),
                              x["tree_mask"], x["scale"], out, lse)
    return out, lse


def errors(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor) -> dict:
    o, ro = out.double(), ref_out.double()
    return {"out_rel": float((o - ro).norm() / ro.norm().clamp_min(1e-30)),
            "out_max_abs": float((o - ro).abs().max()) if o.numel() else 0.0,
            "lse_max_abs": float((lse.double() - ref_lse.double()).abs().max()) if lse.numel() else 0.0,
            "all_written": bool(torch.isfinite(out).all() and torch.isfinite(lse).all())}


# ---------------------------------------------------------------- CPU: interpreter in a subprocess

# name: (b, n, h, l_max, cache_lens, d_v, d_r, dtype, tree kind, num_splits or None, block_m, block_n[, variant])
# variant: "dv2" (half of d_v per program), "keysm" (keys as the M side), "dv2-keysm"
CPU_CASES = {
    "b2-n9-lens70,0-auto": (2, 9, 4, 70, [70, 0], 32, 16, "float32", "tree", None, 16, 16),
    "b2-n9-direct": (2, 9, 4, 70, [33, 70], 32, 16, "float32", "tree", 1, 16, 16),
    "b2-n9-5splits-empty": (2, 9, 3, 70, [17, 0], 32, 16, "float32", "perm", 5, 16, 16),
    "b1-n1-ar": (1, 1, 4, 40, [37], 32, 16, "float32", "chain", 3, 16, 16),
    "b2-n7-chain-lens-over-lmax": (2, 7, 2, 20, [25, 3], 32, 16, "float32", "chain", 2, 16, 32),
    "b2-n9-allzero-lens": (2, 9, 4, 70, [0, 0], 32, 16, "float32", "tree", 4, 16, 16),
    "b1-n5-h1-blockm32": (1, 5, 1, 50, [49], 32, 16, "float32", "perm", 3, 32, 16),
    "bf16-b2-n9-auto": (2, 9, 4, 70, [61, 1], 32, 16, "bfloat16", "tree", None, 16, 16),
    "bf16-b2-n9-direct": (2, 9, 2, 64, [64, 0], 32, 16, "bfloat16", "perm", 1, 16, 64),
    "b1-n70-two-mask-words": (1, 70, 1, 20, [10], 32, 16, "float32", "perm", 2, 16, 16),
    "b2-n67-h2-chain-blockn32": (2, 67, 2, 40, [0, 40], 32, 16, "float32", "chain", 3, 32, 32),
    "real-dims-fp32": (1, 3, 2, 24, [20], 512, 64, "float32", "tree", 2, 16, 16),
    "real-dims-bf16": (2, 2, 2, 24, [5, 24], 512, 64, "bfloat16", "tree", 3, 16, 16),
    "dv2-b2-n9-splits": (2, 9, 3, 70, [70, 12], 32, 16, "float32", "perm", 3, 16, 16, "dv2"),
    "dv2-b2-n5-direct": (2, 5, 4, 40, [0, 39], 32, 16, "float32", "tree", 1, 16, 16, "dv2"),
    "keysm-b2-n9-splits": (2, 9, 2, 70, [70, 0], 32, 16, "float32", "perm", 4, 16, 16, "keysm"),
    "keysm-b1-n70-direct": (1, 70, 1, 20, [13], 32, 16, "float32", "tree", 1, 16, 16, "keysm"),
    "keysm-bf16-b2-n3-auto": (2, 3, 4, 64, [64, 30], 32, 16, "bfloat16", "chain", None, 16, 32, "keysm"),
    "keysm-b1-n70-blockn64": (1, 70, 2, 100, [77], 32, 16, "float32", "perm", 2, 16, 64, "keysm"),
    "dv2-keysm-b2-n9": (2, 9, 2, 50, [50, 7], 32, 16, "float32", "perm", 2, 16, 16, "dv2-keysm"),
    "real-dims-bf16-dv2-keysm": (1, 3, 2, 24, [24], 512, 64, "bfloat16", "tree", 2, 16, 16, "dv2-keysm"),
}


def _cpu_worker() -> None:
    """Runs every CPU_CASES entry through the interpreted kernel; prints one JSON line."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    interpreter_shims()
    from plugins.tree_verify_mla.launcher import (
        Config,
        tree_verify_mla_triton,
        workspace_numel,
    )
    results = {}
    for i, (name, case) in enumerate(CPU_CASES.items()):
        (b, n, h, l_max, lens, d_v, d_r, dt, kind, splits, bm, bn), variant = case[:12], (case[12:] or ("",))[0]
        gen = torch.Generator().manual_seed(1000 + i)
        dtype = getattr(torch, dt)
        x = make_inputs(b, n, h, l_max, lens, d_v, d_r, dtype, gen, kind)
        out = torch.full((b, n, h, d_v), float("nan"), dtype=dtype)
        lse = torch.full((b, n, h), float("nan"), dtype=torch.float32)
        cfg = Config(block_m=bm, block_n=bn, num_warps=4, num_stages=1, dv_split=2 if "dv2" in variant else 1,
                     keys_m="keysm" in variant)
        ws = None
        if i % 2:  # odd cases pass a preallocated (poisoned) workspace
            numel = workspace_numel(b, n, h, d_v, l_max, dtype, "cpu", config=cfg, num_splits=splits, d_qk=d_v + d_r)
            ws = torch.full((numel,), float("nan"))
        tree_verify_mla_triton(x["q"], x["cache"], x["cache_lens"], x["tree_kv"], x["tree_mask"], x["scale"], out,
                               lse, workspace=ws, config=cfg, num_splits=splits)
        results[name] = errors(out, lse, *reference(x, d_v)) | {"dtype": dt}
    print("RESULTS " + json.dumps(results))


@pytest.fixture(scope="module")
def interpreted() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, __file__, "--cpu-worker"], env=env, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"interpreter worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULTS "):])


@pytest.mark.parametrize("name", list(CPU_CASES))
def test_interpreted_kernel_matches_reference(interpreted, name):
    r = interpreted[name]
    out_tol, lse_tol = TOL[getattr(torch, r["dtype"])]
    assert r["all_written"], r
    assert r["out_rel"] <= out_tol and r["lse_max_abs"] <= lse_tol, r


def test_plan_and_workspace_size():
    from plugins.common.device import device_facts
    from plugins.tree_verify_mla.launcher import MAX_SPLITS, plan, workspace_numel
    sms = device_facts("cpu").sms  # no CUDA device: the H200's facts
    for b, n, h, l_max in [(1, 1, 8, 32768), (1, 8, 8, 131072), (1, 64, 64, 32768), (64, 1024, 128, 262144),
                           (8, 8, 8, 32768), (1, 4, 8, 100)]:
        p = plan(b, n, h, l_max, torch.bfloat16, "cpu")
        assert 1 <= p.num_splits <= MAX_SPLITS
        units = b * -(-n * h // p.config.block_m) * p.config.dv_split
        assert p.num_splits == 1 or units * p.num_splits <= sms * p.config.ctas_per_sm  # the planned waves
        ws = workspace_numel(b, n, h, 512, l_max, torch.bfloat16, "cpu")
        assert ws == (0 if p.num_splits == 1 else b * p.num_splits * n * h * 513)
    assert plan(1, 1, 8, 32768, torch.bfloat16, "cpu").num_splits >= 64  # memory-bound: spread over the SMs
    assert plan(64, 1024, 128, 262144, torch.bfloat16, "cpu").num_splits == 1  # enough work: no workspace
    # a device with fewer SMs spreads a memory-bound request over fewer splits
    assert plan(1, 1, 8, 32768, torch.bfloat16, "cpu", num_sms=33).num_splits < plan(
        1, 1, 8, 32768, torch.bfloat16, "cpu").num_splits


def test_short_caches_split_to_one_wave(monkeypatch):
    """h 8 at L = 4K (the K2.6 rank's 4K rounds): N = 1 splits one key tile per split; N = 17 fills one wave
    (22 x 6 programs on 132 SMs) because its 6 MB of partials stay in the L2; with a small L2 the partial cap
    (PARTIAL_SHARE of the request's bytes) binds again."""
    import dataclasses

    import plugins.tree_verify_mla.launcher as launcher
    assert launcher.plan(1, 1, 8, 4096, torch.bfloat16, "cpu").num_splits == 129  # 128 cache tiles + 1 tree tile
    assert launcher.plan(1, 17, 8, 4096, torch.bfloat16, "cpu").num_splits == 22
    facts = launcher.device_facts("cpu")
    monkeypatch.setattr(launcher, "device_facts", lambda device: dataclasses.replace(facts, l2_bytes=4 << 20))
    assert launcher.plan(1, 17, 8, 4096, torch.bfloat16, "cpu").num_splits == 13


def test_launcher_rejects_bad_workspace_and_layout():
    from plugins.tree_verify_mla.launcher import tree_verify_mla_triton
    gen = torch.Generator().manual_seed(0)
    x = make_inputs(1, 2, 8, 4096, [100], 32, 16, torch.float32, gen)
    out, lse = torch.empty(1, 2, 8, 32), torch.empty(1, 2, 8)
    args = (x["q"], x["cache"], x["cache_lens"], x["tree_kv"], x["tree_mask"], x["scale"])
    with pytest.raises(ValueError, match="workspace"):
        tree_verify_mla_triton(*args, out, lse, workspace=torch.empty(3), num_splits=4)
    with pytest.raises(ValueError, match="out must have a contiguous last dim"):
        tree_verify_mla_triton(*args, torch.empty(1, 2, 8, 64)[..., ::2], lse)
    bad = make_inputs(1, 2, 8, 64, [10], 24, 16, torch.float32, gen)
    with pytest.raises(ValueError, match="d_v must be a power of two"):
        tree_verify_mla_triton(bad["q"], bad["cache"], bad["cache_lens"], bad["tree_kv"], bad["tree_mask"], 0.1,
                               torch.empty(1, 2, 8, 24), lse)


# ---------------------------------------------------------------- GPU: random sweep and graph capture

def random_lens(gen: torch.Generator, b: int, l_max: int) -> list[int]:
    """Committed lengths of b requests: 0, full, past l_max (the kernel clamps) or uniform in [0, l_max]."""
    lens = []
    for _ in range(b):
        u = float(torch.rand(1, generator=gen))
        lens.append(0 if u < 0.1 else l_max if u < 0.25 else l_max + 3 if u < 0.3
                    else int(torch.randint(0, l_max + 1, (1,), generator=gen)))
    return lens


def _random_shape(gen: torch.Generator, i: int) -> dict:
    def pick(xs):
        return xs[int(torch.randint(0, len(xs), (1,), generator=gen))]
    dtype = torch.float32 if i % 4 == 3 else torch.bfloat16
    h = pick([8, 8, 16, 32, 64, 128, int(torch.randint(1, 129, (1,), generator=gen))])
    n = pick([1, 2, 3, 4, 5, 8, 9, 16, 31, 64, 65, 100, 127, 256, 257, 511, 1024])
    b = pick([1, 1, 2, 3, 4, 8, 16, 64])
    l_max = pick([1, 7, 64, 65, 300, 1000, 4097, 32768, 70000, 131072, 262144])
    # keep the reference's [b, n*h, l + n] fp32 scores (and the cache) to a few GB
    while b * n * h * (l_max + n) > (3e7 if dtype == torch.float32 else 2e8) or b * l_max > 1_000_000:
        if b > 1:
            b = max(1, b // 2)
        elif l_max > 64:
            l_max //= 2
        elif n > 1:
            n //= 2
        else:
            h = max(1, h // 2)
    lens = random_lens(gen, b, l_max)
    kind = pick(["tree", "tree", "perm", "chain"])
    splits = None if i % 3 else int(torch.randint(1, 65, (1,), generator=gen))
    path = "op" if i % 5 == 0 else "launcher"
    # launcher calls on bf16 also try the benchmark's alternative configs (every kernel variant) and PDL off
    config = pick(_gpu_variants()) if path == "launcher" and dtype == torch.bfloat16 and i % 2 else None
    return {"b": b, "n": n, "h": h, "l_max": l_max, "lens": lens, "dtype": dtype, "kind": kind, "splits": splits,
            "path": path, "config": config, "pdl": i % 7 != 4}


def _gpu_variants() -> list:
    from plugins.tree_verify_mla.launcher import Config
    return [Config(16, 32, 4, 4), Config(16, 32, 4, 3, ctas_per_sm=2), Config(16, 64, 4, 3), Config(32, 32, 8, 4),
            Config(64, 32, 8, 3), Config(64, 64, 8, 2), Config(16, 64, 4, 2, keys_m=True),
            Config(32, 64, 4, 2, keys_m=True), Config(64, 64, 4, 2, dv_split=2), Config(64, 32, 4, 3, dv_split=2),
            Config(16, 32, 4, 2, ctas_per_sm=3)]


def _write_summary(doc: dict) -> None:
    out_dir = os.environ.get("KDTREE_RESULTS_DIR")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "tree_verify_mla-device-test.json").write_text(json.dumps(doc, indent=1) + "\n")


@pytest.mark.gpu
def test_gpu_random_shapes():
    import plugins.tree_verify_mla  # noqa: F401  (registers the CUDA kernel)
    from plugins.tree_verify_mla.launcher import tree_verify_mla_triton, workspace_numel
    gen = torch.Generator().manual_seed(2026)
    rows, failures = [], []
    for i in range(gpu_cases(240)):
        s = _random_shape(gen, i)
        b, n, h, l_max, dtype = s["b"], s["n"], s["h"], s["l_max"], s["dtype"]
        x = make_inputs(b, n, h, l_max, s["lens"], 512, 64, dtype, gen, s["kind"], device="cuda")
        out = torch.full((b, n, h, 512), float("nan"), dtype=dtype, device="cuda")
        lse = torch.full((b, n, h), float("nan"), dtype=torch.float32, device="cuda")
        args = (x["q"], x["cache"], x["cache_lens"], x["tree_kv"], x["tree_mask"], x["scale"], out, lse)
        if s["path"] == "op":
            torch.ops.kdtree.tree_verify_mla(*args, None)  # every arg explicit (torch 2.11)
        else:
            ws = torch.full((workspace_numel(b, n, h, 512, l_max, dtype, "cuda", config=s["config"],
                                             num_splits=s["splits"]),), float("nan"), device="cuda")
            tree_verify_mla_triton(*args, workspace=ws, config=s["config"], num_splits=s["splits"], pdl=s["pdl"])
        torch.cuda.synchronize()
        e = errors(out, lse, *reference(x, 512))
        out_tol, lse_tol = TOL[dtype]
        ok = e["all_written"] and e["out_rel"] <= out_tol and e["lse_max_abs"] <= lse_tol
        row = {k: (str(v) if k == "dtype" else v.tag() if k == "config" and v else v) for k, v in s.items()} \
            | e | {"pass": ok}
        rows.append(row)
        if not ok:
            failures.append(row)
        del x, out, lse
    doc = {"op": "tree_verify_mla", "device": torch.cuda.get_device_name(), "shapes_checked": len(rows),
           "failures": len(failures), "tolerances": {str(k): v for k, v in TOL.items()},
           "max_out_rel": {dt: max((r["out_rel"] for r in rows if r["dtype"] == dt), default=0.0)
                           for dt in ("torch.bfloat16", "torch.float32")},
           "max_lse_abs": max(r["lse_max_abs"] for r in rows), "pass": not failures, "rows": rows}
    _write_summary(doc)
    print(f"tree_verify_mla: {len(rows)} shapes, {len(failures)} failures, max out rel {doc['max_out_rel']}, "
          f"max lse abs {doc['max_lse_abs']:.3g}")
    assert not failures, failures[:5]


def graph_replay_errors(b: int, n: int, h: int, l_max: int, seed: int) -> dict:
    """errors() of the op captured in a CUDA graph (with its workspace: the split path) and replayed on new inputs
    copied into the captured buffers (request 0 at 4000 then 1234 committed rows, request 1 at 0 then l_max - 1)."""
    import plugins.tree_verify_mla  # noqa: F401  (registers the CUDA kernel)
    from plugins.tree_verify_mla.launcher import workspace_numel
    gen = torch.Generator().manual_seed(seed)
    x = make_inputs(b, n, h, l_max, [4000, 0], 512, 64, torch.bfloat16, gen, device="cuda")
    ws = torch.empty(workspace_numel(b, n, h, 512, l_max, torch.bfloat16, "cuda"), device="cuda")
    assert ws.numel() > 0  # the split path (partials + combine) is what the graph must hold
    out = torch.empty(b, n, h, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(b, n, h, device="cuda")

    def step():
        torch.ops.kdtree.tree_verify_mla(x["q"], x["cache"], x["cache_lens"], x["tree_kv"], x["tree_mask"],
                                         x["scale"], out, lse, ws)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    y = make_inputs(b, n, h, l_max, [1234, l_max - 1], 512, 64, torch.bfloat16, gen, kind="perm", device="cuda")
    for key in ("q", "cache", "cache_lens", "tree_kv", "tree_mask"):
        x[key].copy_(y[key])
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    y["scale"] = x["scale"]
    return errors(out, lse, *reference(y, 512))


@pytest.mark.gpu
@pytest.mark.parametrize("b,n,h,l_max", [(2, 17, 16, 5000), (2, 1, 8, 20000)])  # the wgmma kernel, the keys_m table
def test_gpu_cuda_graph_capture_replays_new_inputs(b, n, h, l_max):
    e = graph_replay_errors(b, n, h, l_max, 7)
    assert e["all_written"] and e["out_rel"] <= TOL[torch.bfloat16][0] and e["lse_max_abs"] <= TOL[torch.bfloat16][1], e


def test_long_tile_is_planned_for_an_ar_step_over_16k_to_64k_only(monkeypatch):
    """launcher.LONG_TILE (on by default since 2026-12-06's measurement): the 64-key 3-stage tile for at most 16
    query rows over a 16-bit cache of 16K to 64K rows; the table elsewhere (4K, 128K, 17 tree tokens, fp32, the switch
    off)."""
    from plugins.tree_verify_mla import launcher
    assert launcher.LONG_TILE
    monkeypatch.setattr(launcher, "LONG_TILE", False)
    assert launcher.plan(1, 1, 8, 32768, torch.bfloat16, "cpu").config != launcher.LONG_TILE_CONFIG
    monkeypatch.setattr(launcher, "LONG_TILE", True)
    long = launcher.plan(1, 1, 8, 32768, torch.bfloat16, "cpu")
    assert long.config == launcher.LONG_TILE_CONFIG and long.num_splits == 132  # one program per SM
    assert launcher.plan(1, 2, 8, 16384, torch.bfloat16, "cpu").config == launcher.LONG_TILE_CONFIG
    for b, n, l_max, dtype in ((1, 1, 4096, torch.bfloat16), (1, 1, 131072, torch.bfloat16),
                               (1, 17, 32768, torch.bfloat16), (1, 1, 32768, torch.float32)):
        assert launcher.plan(b, n, 8, l_max, dtype, "cpu").config != launcher.LONG_TILE_CONFIG, (n, l_max, dtype)


@pytest.mark.gpu
def test_gpu_long_tile_matches_the_reference(monkeypatch):
    """KDTREE_ATTN_LONG_TILE (launcher.LONG_TILE): the AR step's 64-key tiles over a 16K-64K cache, against the
    reference at 32K (full and partly filled caches, b = 2 with a short request beside) and taken by the plan."""
    import plugins.tree_verify_mla  # noqa: F401
    from plugins.tree_verify_mla import launcher
    monkeypatch.setattr(launcher, "LONG_TILE", True)
    monkeypatch.setattr(launcher, "WGMMA_AR", False)  # on sm_90 the AR step's rows take the wgmma kernel before it
    assert launcher.plan(1, 1, 8, 32768, torch.bfloat16, "cuda").config == launcher.LONG_TILE_CONFIG
    assert launcher.plan(1, 1, 8, 4096, torch.bfloat16, "cuda").config != launcher.LONG_TILE_CONFIG
    gen = torch.Generator().manual_seed(12)
    for b, n, h, l_max, lens in ((1, 1, 8, 32768, [32768]), (1, 2, 8, 32768, [20000]), (2, 1, 8, 20000, [19000, 5])):
        x = make_inputs(b, n, h, l_max, lens, 512, 64, torch.bfloat16, gen, device="cuda")
        out = torch.empty(b, n, h, 512, dtype=torch.bfloat16, device="cuda")
        lse = torch.empty(b, n, h, device="cuda")
        torch.ops.kdtree.tree_verify_mla(x["q"], x["cache"], x["cache_lens"], x["tree_kv"], x["tree_mask"], x["scale"],
                                         out, lse, None)
        e = errors(out, lse, *reference(x, 512))
        assert e["all_written"] and e["out_rel"] <= TOL[torch.bfloat16][0] \
            and e["lse_max_abs"] <= TOL[torch.bfloat16][1], (b, n, l_max, e)


@pytest.mark.gpu
def test_gpu_cache_prefetch_changes_no_bit(monkeypatch):
    """KDTREE_ATTN_PREFETCH (launcher.CACHE_PREFETCH): the split programs' L2 prefetch of their first cache tiles,
    issued before the PDL wait, is a hint: the same bits at 4K / 32K, the h = 8 table configs, eager and in a graph
    behind a kernel that runs while the prefetch is in flight."""
    import plugins.tree_verify_mla  # noqa: F401
    from plugins.tree_verify_mla import launcher
    gen = torch.Generator().manual_seed(11)
    for b, n, h, l_max, lens in ((1, 1, 8, 4096, [4096]), (1, 17, 8, 4096, [4000]), (1, 4, 8, 32768, [30000]),
                                 (2, 9, 8, 5000, [4999, 17])):
        x = make_inputs(b, n, h, l_max, lens, 512, 64, torch.bfloat16, gen, device="cuda")
        outs = []
        for on in (False, True):
            monkeypatch.setattr(launcher, "CACHE_PREFETCH", on)
            out = torch.empty(b, n, h, 512, dtype=torch.bfloat16, device="cuda")
            lse = torch.empty(b, n, h, device="cuda")
            args = (x["q"], x["cache"], x["cache_lens"], x["tree_kv"], x["tree_mask"], x["scale"], out, lse, None)
            torch.ops.kdtree.tree_verify_mla(*args)
            eager = out.clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                x["q"].mul_(1.0)  # a predecessor kernel in the stream
                torch.ops.kdtree.tree_verify_mla(*args)
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager), (b, n, l_max, on)
            outs.append(eager)
        assert torch.equal(outs[0], outs[1]), (b, n, l_max)


@pytest.mark.gpu
def test_gpu_wgmma_few_rows_and_early_tiles_match_the_reference(monkeypatch):
    """KDTREE_ATTN_WGMMA_AR (launcher.WGMMA_AR: 1..32 query rows on the wgmma kernel) and KDTREE_ATTN_WGMMA_EARLY /
    _EARLY2 (wgmma_launch.EARLY / EARLY2: a split's first / first two committed tiles loaded before the PDL wait):
    against the reference on fresh random inputs (AR steps, a tree-only request, DDTree rounds, one split and a few),
    the same bits with the early loads off, on and on for two tiles, eager and replayed in a graph behind a kernel
    that runs while the tiles are in flight."""
    import plugins.tree_verify_mla  # noqa: F401
    from plugins.tree_verify_mla import launcher, wgmma_launch
    from plugins.tree_verify_mla.launcher import tree_verify_mla_triton, workspace_numel
    monkeypatch.setattr(launcher, "WGMMA_AR", True)
    assert launcher.plan(1, 1, 8, 4096, torch.bfloat16, "cuda").config == launcher.WGMMA_CONFIG
    gen = torch.Generator().manual_seed(31)
    for b, n, h, l_max, lens, splits in ((1, 1, 8, 4096, [4096], None), (1, 1, 8, 4096, [1000], None),
                                         (2, 1, 8, 5000, [4999, 17], None), (1, 2, 8, 300, [0], None),
                                         (1, 1, 8, 4096, [4095], 1), (1, 3, 8, 4096, [2000], 3),
                                         (1, 17, 8, 4096, [4000], None), (2, 9, 8, 5000, [4999, 17], None),
                                         (1, 4, 8, 32768, [30000], None)):
        x = make_inputs(b, n, h, l_max, lens, 512, 64, torch.bfloat16, gen, device="cuda")
        ws = torch.full((max(1, workspace_numel(b, n, h, 512, l_max, torch.bfloat16, "cuda", num_splits=splits)),),
                        float("nan"), device="cuda")
        outs = []
        for early, early2 in ((False, False), (True, False), (True, True)):
            monkeypatch.setattr(wgmma_launch, "EARLY", early)
            monkeypatch.setattr(wgmma_launch, "EARLY2", early2)
            out = torch.full((b, n, h, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
            lse = torch.full((b, n, h), float("nan"), device="cuda")

            def call():
                tree_verify_mla_triton(x["q"], x["cache"], x["cache_lens"], x["tree_kv"], x["tree_mask"], x["scale"],
                                       out, lse, workspace=ws, num_splits=splits)  # noqa: B023

            call()
            torch.cuda.synchronize()
            e = errors(out, lse, *reference(x, 512))
            assert e["all_written"] and e["out_rel"] <= TOL[torch.bfloat16][0] \
                and e["lse_max_abs"] <= TOL[torch.bfloat16][1], (b, n, l_max, lens, splits, early, e)
            eager = out.clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                x["q"].mul_(1.0)  # a predecessor kernel in the stream
                call()
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, eager), (b, n, l_max, early, early2)
            outs.append(eager)
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), (b, n, l_max, lens, splits)


@pytest.mark.gpu
def test_gpu_wgmma_wide_takes_more_than_1024_rows_and_matches_the_reference(monkeypatch):
    """KDTREE_ATTN_WGMMA_WIDE (launcher.WGMMA_WIDE): DDTree rounds of budget 128 / 256 (1032 / 2056 query rows at h 8)
    on the wgmma kernel, against the reference on fresh random inputs, eager and in a graph."""
    import plugins.tree_verify_mla  # noqa: F401
    from plugins.tree_verify_mla import launcher
    monkeypatch.setattr(launcher, "WGMMA_WIDE", False)
    assert not launcher.plan(1, 129, 8, 4096, torch.bfloat16, "cuda").config.wgmma  # off: the Triton table
    monkeypatch.setattr(launcher, "WGMMA_WIDE", True)
    assert launcher.plan(1, 129, 8, 4096, torch.bfloat16, "cuda").config.wgmma
    gen = torch.Generator().manual_seed(41)
    for b, n, l_max, lens in ((1, 129, 4096, [4000]), (1, 257, 2048, [2048]), (2, 130, 1000, [999, 3])):
        x = make_inputs(b, n, 8, l_max, lens, 512, 64, torch.bfloat16, gen, device="cuda")
        out = torch.full((b, n, 8, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((b, n, 8), float("nan"), device="cuda")
        args = (x["q"], x["cache"], x["cache_lens"], x["tree_kv"], x["tree_mask"], x["scale"], out, lse, None)
        torch.ops.kdtree.tree_verify_mla(*args)
        torch.cuda.synchronize()
        e = errors(out, lse, *reference(x, 512))
        assert e["all_written"] and e["out_rel"] <= TOL[torch.bfloat16][0] \
            and e["lse_max_abs"] <= TOL[torch.bfloat16][1], (b, n, l_max, lens, e)
        eager = out.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch.ops.kdtree.tree_verify_mla(*args)
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), (b, n, l_max)

if __name__ == "__main__" and sys.argv[1:] == ["--cpu-worker"]:
    _cpu_worker()
