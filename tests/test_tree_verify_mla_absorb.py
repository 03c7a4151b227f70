"""kdtree::tree_verify_mla_absorb: the attention with its combine launch also multiplying by W_UV (the values'
absorption, layer_fusion's mla_v_absorb), against the references.

CPU: the op's reference equals tree_verify_mla's and mla_v_absorb's references bit for bit (the CPU path of the
model is unchanged); the Triton kernels under TRITON_INTERPRET=1 in a subprocess (split and one-split paths, one to
eight value blocks a row); the tile plan.
GPU (`-m gpu`): >= 200 fresh random cases (bf16 and fp32, the Triton and wgmma split kernels, 1 .. 64 splits,
poisoned outputs) against the reference of out . W_UV^T from the fp32 / fp64 attention; a CUDA graph replaying new
inputs.  Tolerances of out_v: against the reference's out . W_UV^T as out's (the attention's out is rounded before
the product); against the kernel's own out . W_UV^T in fp64, its own rounding only (bf16 4e-3, fp32 1e-6).
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
from test_tree_verify_mla_kernel import TOL, errors, make_inputs, random_lens, reference

from interpreter import interpreter_shims

ROOT = Path(__file__).resolve().parent.parent


def value_errors(out_v: torch.Tensor, ref_out: torch.Tensor, w_uv: torch.Tensor, out: torch.Tensor) -> dict:
    """out_v against ref_out [b, n, h, d_v] (fp32 / fp64) . W_UV^T in that precision (v_rel), and against the
    kernel's own out . W_UV^T in fp64 (v_own_rel: the absorption alone, out_v's rounding)."""
    def rel(ref: torch.Tensor) -> float:
        return float((out_v.double() - ref).norm() / ref.norm().clamp_min(1e-30))
    return {"v_rel": rel(torch.einsum("bnhc,huc->bnhu", ref_out.double(), w_uv.double())),
            "v_own_rel": rel(torch.einsum("bnhc,huc->bnhu", out.double(), w_uv.double())),
            "v_written": bool(torch.isfinite(out_v).all())}


V_OWN_TOL = {torch.float32: 1e-6, torch.bfloat16: 4e-3}  # out_v's own rounding: 2^-9 relative a bf16 element


def run_absorb(x: dict, w_uv: torch.Tensor, d_v: int, launcher_kw: dict | None = None) -> tuple:
    """(out, lse, out_v) of the op (launcher_kw None) or of launcher.tree_verify_mla_triton with w_uv, from
    NaN-poisoned outputs."""
    b, n, h, _ = x["q"].shape
    dev, dt = x["q"].device, x["q"].dtype
    out = torch.full((b, n, h, d_v), float("nan"), dtype=dt, device=dev)
    lse = torch.full((b, n, h), float("nan"), dtype=torch.float32, device=dev)
    out_v = torch.full((b, n, h, w_uv.shape[1]), float("nan"), dtype=dt, device=dev)
    args = (x["q"], x["cache"], x["cache_lens"], x["tree_kv"], x["tree_mask"], x["scale"])
    if launcher_kw is None:
        torch.ops.kdtree.tree_verify_mla_absorb(*args, w_uv, out, lse, out_v, None)
    else:
        from plugins.tree_verify_mla.launcher import tree_verify_mla_triton
        tree_verify_mla_triton(*args, out, lse, w_uv=w_uv, out_v=out_v, **launcher_kw)
    return out, lse, out_v


# ---------------------------------------------------------------- CPU

def test_cpu_op_is_the_two_references_bit_for_bit():
    """The runtime's CPU numerics are unchanged: the op = tree_verify_mla's reference, then mla_v_absorb's."""
    import plugins.tree_verify_mla  # noqa: F401  (registers the op)
    from plugins.layer_fusion.reference import mla_v_absorb_reference
    from plugins.tree_verify_mla.reference import tree_verify_mla_reference
    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16):
        x = make_inputs(2, 5, 4, 40, [40, 3], 64, 16, dtype, gen)
        w_uv = torch.randn(4, 24, 64, generator=gen).to(dtype)  # [h, u, d_v]
        out, lse, out_v = run_absorb(x, w_uv, 64)
        ref_out = torch.empty_like(out)
        ref_lse = torch.empty_like(lse)
        tree_verify_mla_reference(x["q"], x["cache"], x["cache_lens"], x["tree_kv"], x["tree_mask"], x["scale"],
                                  ref_out, ref_lse)
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
        assert torch.equal(out_v, mla_v_absorb_reference(ref_out.view(10, 4, 64), w_uv).view(2, 5, 4, 24)), dtype


def test_op_rejects_bad_value_tensors():
    import plugins.tree_verify_mla  # noqa: F401
    gen = torch.Generator().manual_seed(6)
    x = make_inputs(1, 3, 2, 16, [16], 32, 16, torch.float32, gen)
    out, lse = torch.empty(1, 3, 2, 32), torch.empty(1, 3, 2)
    args = (x["q"], x["cache"], x["cache_lens"], x["tree_kv"], x["tree_mask"], x["scale"])
    with pytest.raises(ValueError, match="w_uv must be"):
        torch.ops.kdtree.tree_verify_mla_absorb(*args, torch.empty(3, 8, 32), out, lse, torch.empty(1, 3, 2, 8), None)
    with pytest.raises(ValueError, match="out_v must be"):
        torch.ops.kdtree.tree_verify_mla_absorb(*args, torch.empty(2, 8, 32), out, lse, torch.empty(1, 3, 2, 9), None)
    with pytest.raises(ValueError, match="must be out's"):
        torch.ops.kdtree.tree_verify_mla_absorb(*args, torch.empty(2, 8, 32, dtype=torch.bfloat16), out, lse,
                                                torch.empty(1, 3, 2, 8), None)


def test_absorb_plan_fills_the_sms_once_per_row_set():
    from plugins.tree_verify_mla.launcher import ABSORB_TILE, absorb_plan
    assert absorb_plan(8, 44, 128, 512, 132).block_u == 16  # an AR step: 8 rows x 8 blocks
    assert absorb_plan(136, 44, 128, 512, 132).block_u == 128  # a 17-token round: one block a row
    assert absorb_plan(40, 44, 128, 512, 132).block_u == 32
    for rows in (1, 8, 40, 136, 4096):
        for s in (1, 2, 44, 512):
            p = absorb_plan(rows, s, 128, 512, 132)
            s_pad = 1 if s == 1 else 1 << (s - 1).bit_length()
            assert 512 % p.block_c == 0 and p.block_c * max(s_pad, p.block_u) <= max(ABSORB_TILE, 16 * s_pad), p


# name: (b, n, h, l_max, lens, d_v, d_r, u, dtype, tree kind, num_splits, num_sms)
CPU_CASES = {
    "fp32-splits-8blocks": (1, 1, 4, 40, [37], 32, 16, 128, "float32", "chain", 3, 64),
    "fp32-b2-splits-empty": (2, 9, 3, 70, [17, 0], 32, 16, 24, "float32", "perm", 5, 132),
    "fp32-direct": (2, 9, 2, 70, [33, 70], 32, 16, 48, "float32", "tree", 1, 4),
    "bf16-real-dims-splits": (2, 2, 2, 24, [5, 24], 512, 64, 128, "bfloat16", "tree", 3, 16),
    "bf16-real-dims-direct": (1, 3, 2, 24, [20], 512, 64, 128, "bfloat16", "tree", 1, 132),
}


def _cpu_worker() -> None:
    """Runs every CPU_CASES entry through the interpreted kernels; prints one JSON line."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    interpreter_shims()
    from plugins.tree_verify_mla.launcher import Config
    results = {}
    for i, (name, (b, n, h, l_max, lens, d_v, d_r, u, dt, kind, splits, sms)) in enumerate(CPU_CASES.items()):
        gen = torch.Generator().manual_seed(3000 + i)
        dtype = getattr(torch, dt)
        x = make_inputs(b, n, h, l_max, lens, d_v, d_r, dtype, gen, kind)
        w_uv = torch.randn(h, u, d_v, generator=gen).to(dtype)  # [h, u, d_v]
        out, lse, out_v = run_absorb(x, w_uv, d_v, {"config": Config(16, 16, 4, 1), "num_splits": splits,
                                                    "num_sms": sms})
        ref_out, ref_lse = reference(x, d_v)
        results[name] = errors(out, lse, ref_out, ref_lse) | value_errors(out_v, ref_out, w_uv, out) | {"dtype": dt}
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
def test_interpreted_kernels_match_the_reference(interpreted, name):
    r = interpreted[name]
    out_tol, lse_tol = TOL[getattr(torch, r["dtype"])]
    assert r["all_written"] and r["v_written"], r
    assert r["out_rel"] <= out_tol and r["lse_max_abs"] <= lse_tol and r["v_rel"] <= out_tol, r
    assert r["v_own_rel"] <= V_OWN_TOL[getattr(torch, r["dtype"])], r


# ---------------------------------------------------------------- GPU

def _write_summary(doc: dict) -> None:
    out_dir = os.environ.get("KDTREE_RESULTS_DIR")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "tree_verify_mla_absorb-device-test.json").write_text(json.dumps(doc, indent=1) + "\n")


@pytest.mark.gpu
def test_gpu_random_cases():
    import plugins.tree_verify_mla  # noqa: F401  (registers the CUDA kernel)
    gen = torch.Generator().manual_seed(2027)
    rows, failures = [], []
    for i in range(gpu_cases(200)):
        b = int(torch.randint(1, 3, (1,), generator=gen))
        n = int(torch.tensor([1, 1, 2, 5, 9, 17, 17, 33, 64])[torch.randint(0, 9, (1,), generator=gen)])
        h = int(torch.tensor([1, 2, 4, 8, 16])[torch.randint(0, 5, (1,), generator=gen)])
        l_max = int(torch.randint(1, 9000, (1,), generator=gen))
        dtype = torch.bfloat16 if i % 4 else torch.float32
        kind = ("tree", "perm", "chain")[i % 3]
        x = make_inputs(b, n, h, l_max, random_lens(gen, b, l_max), 512, 64, dtype, gen, kind, device="cuda")
        w_uv = torch.randn(h, 128, 512, device="cuda").to(dtype) * 0.05  # [h, u, d_v]
        path = ("op", "splits")[i % 2]
        kw = None if path == "op" else {"num_splits": int(torch.randint(1, 65, (1,), generator=gen)),
                                         "pdl": bool(i % 3)}
        out, lse, out_v = run_absorb(x, w_uv, 512, kw)
        torch.cuda.synchronize()
        ref_out, ref_lse = reference(x, 512)
        e = errors(out, lse, ref_out, ref_lse) | value_errors(out_v, ref_out, w_uv, out)
        out_tol, lse_tol = TOL[dtype]
        ok = e["all_written"] and e["v_written"] and e["out_rel"] <= out_tol and e["lse_max_abs"] <= lse_tol \
            and e["v_rel"] <= out_tol and e["v_own_rel"] <= V_OWN_TOL[dtype]
        row = {"b": b, "n": n, "h": h, "l_max": l_max, "dtype": str(dtype), "kind": kind, "path": path,
               "splits": kw and kw["num_splits"]} | e | {"pass": ok}
        rows.append(row)
        if not ok:
            failures.append(row)
    max_rel = {dt: max((r["v_rel"] for r in rows if r["dtype"] == dt), default=0.0)
               for dt in ("torch.bfloat16", "torch.float32")}
    doc = {"op": "tree_verify_mla_absorb", "device": torch.cuda.get_device_name(), "cases": len(rows),
           "failures": len(failures), "max_v_rel": max_rel, "pass": not failures, "rows": rows}
    _write_summary(doc)
    print(f"tree_verify_mla_absorb: {len(rows)} cases, {len(failures)} failures, max v rel {doc['max_v_rel']}")
    assert not failures, failures[:5]


@pytest.mark.gpu
@pytest.mark.parametrize("b,n,h,l_max", [(1, 17, 8, 5000), (1, 1, 8, 4096)])  # the wgmma kernel, an AR step
def test_gpu_graph_replays_new_inputs(b, n, h, l_max):
    import plugins.tree_verify_mla  # noqa: F401
    from plugins.tree_verify_mla.launcher import workspace_numel
    gen = torch.Generator().manual_seed(11)
    x = make_inputs(b, n, h, l_max, [l_max - 7], 512, 64, torch.bfloat16, gen, device="cuda")
    w_uv = (torch.randn(h, 128, 512, device="cuda") * 0.05).to(torch.bfloat16)
    ws = torch.empty(workspace_numel(b, n, h, 512, l_max, torch.bfloat16, "cuda"), device="cuda")
    out = torch.empty(b, n, h, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(b, n, h, device="cuda")
    out_v = torch.empty(b, n, h, 128, dtype=torch.bfloat16, device="cuda")

    def step():
        torch.ops.kdtree.tree_verify_mla_absorb(x["q"], x["cache"], x["cache_lens"], x["tree_kv"], x["tree_mask"],
                                                x["scale"], w_uv, out, lse, out_v, ws)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    y = make_inputs(b, n, h, l_max, [1234], 512, 64, torch.bfloat16, gen, kind="perm", device="cuda")
    for key in ("q", "cache", "cache_lens", "tree_kv", "tree_mask"):
        x[key].copy_(y[key])
    out_v.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    y["scale"] = x["scale"]
    ref_out, _ = reference(y, 512)
    e = value_errors(out_v, ref_out, w_uv, out)
    assert e["v_written"] and e["v_rel"] <= TOL[torch.bfloat16][0] and e["v_own_rel"] <= V_OWN_TOL[torch.bfloat16], e


if __name__ == "__main__" and sys.argv[1:] == ["--cpu-worker"]:
    _cpu_worker()
