"""tree_build's GPU algorithm and Triton kernels against the reference heap, exactly.

- the torch prototype of the level-parallel algorithm (plugins/tree_build/parallel_reference.py) vs the
  heap on ~300 random tie-heavy cases and a hand-made fp32 absorption case;
- the Triton kernels under TRITON_INTERPRET=1 on CPU (run in a subprocess, so that no other test module
  sees the interpreter's triton): end to end from logits, stage 2 alone on crafted candidate lists, and
  prefix-closed (the first b + 1 nodes of the tree of budget B are the tree of budget b: check_prefix_closed,
  which tests/test_budget_auto.py runs on the reference);
- on CUDA (pytest -m gpu): >= 200 random shapes up to the Kimi vocabulary, B 1024, depth 16, all six
  outputs equal; a JSON summary goes to $KDTREE_RESULTS_DIR/tree_build-device-test.json when set
  ($KDTREE_TREE_BUILD_SHAPES overrides the 240 shapes); their kernel variants are compiled first, in parallel
  processes (tests/compile_warmup.py).

`python tests/test_tree_build_kernel.py --interpret` runs the interpreter worker by hand.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gpu_cases import gpu_cases

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from plugins.common.bitmask import mask_words  # noqa: E402
from plugins.tree_build.parallel_reference import best_prefixes_parallel  # noqa: E402
from plugins.tree_build.reference import _best_first, build_from_topk_reference, topk_logprobs_reference  # noqa: E402

# lp [D, K] where a naive rectangle pruning without the tie step is wrong at B = 22: the two best
# depth-2 parents differ by less than half an ulp of the depth-3 scores, so their children tie and
# the lexicographically smaller (lower-scoring) parent's children come first.
ABSORPTION_LP = np.array([[0, -6e-8] + [-5] * 6, [0, -1e-7] + [-5] * 6, [-2] * 8], dtype=np.float32)


def random_lp(rng: random.Random, depth: int, k: int, mode: int) -> np.ndarray:
    """[depth, k] fp32 rows sorted descending; modes 0, 2, 3 make many exactly tied and absorbed sums."""
    if mode == 0:
        rows = [[-rng.choice([0.25, 0.5, 0.5, 1.0, 2.0]) for _ in range(k)] for _ in range(depth)]
    elif mode == 1:
        rows = [[-rng.expovariate(1.0) for _ in range(k)] for _ in range(depth)]
    elif mode == 2:
        vals = [0, -6e-8, -1.2e-7, -1.8e-7, -1e-7, -3e-7, -1, -1 - 1.2e-7, -2, -2 - 2.4e-7, -3, -4]
        rows = [[rng.choice(vals[:rng.randint(3, len(vals))]) for _ in range(k)] for _ in range(depth)]
    else:
        rows = [[-rng.randint(0, 8) / 4 - rng.choice([0, 1e-6, 16.0, 16.000002]) for _ in range(k)]
                for _ in range(depth)]
    return np.array([sorted(r, reverse=True) for r in rows], dtype=np.float32)


def _heap_nodes(lp: np.ndarray, budget: int) -> tuple[list[int], list[int], list[int]]:
    nodes = _best_first(lp, budget)
    return [len(r) for r, _ in nodes], [r[-1] for r, _ in nodes], [p for _, p in nodes]


def test_parallel_reference_matches_heap():
    for case in range(300):
        rng = random.Random(case)
        depth, k = rng.randint(1, 5), rng.randint(1, 10)
        total = sum(k ** d for d in range(1, depth + 1))
        budget = rng.randint(1, min(total, 60)) if case % 10 else total if total <= 60 else 60
        lp = random_lp(rng, depth, k, case % 4)
        d, r, p = best_prefixes_parallel(torch.from_numpy(lp), budget)
        assert (d.tolist(), r.tolist(), p.tolist()) == _heap_nodes(lp, budget), f"case {case}"
    for budget in (20, 22, 24):
        d, r, p = best_prefixes_parallel(torch.from_numpy(ABSORPTION_LP), budget)
        assert (d.tolist(), r.tolist(), p.tolist()) == _heap_nodes(ABSORPTION_LP, budget)


# ---------------------------------------------------------------------------------------------------
# shared by the interpreter worker and the GPU test

def make_logits(rng: random.Random, gen: torch.Generator, b: int, depth: int, vocab: int, mode: str,
                device) -> torch.Tensor:
    """[b, D, V] fresh random logits; 'quant' and 'few' make many exact duplicates."""
    shape = (b, depth, vocab)
    if mode == "randn":
        x = torch.randn(shape, generator=gen) * rng.choice([0.5, 3.0, 10.0])
    elif mode == "quant":
        x = torch.randint(-40, 40, shape, generator=gen).float() / 4
    elif mode == "few":
        x = torch.randint(0, 3, shape, generator=gen).float() * 0.5
    elif mode == "peaked":
        x = torch.randn(shape, generator=gen)
        x[..., rng.randrange(vocab)] += 25.0
    elif mode == "masked":  # vocabulary padding at -inf
        x = torch.randn(shape, generator=gen) * 2
        x[..., vocab - max(1, vocab // 10):] = float("-inf")
    else:
        raise ValueError(mode)
    return x.to(device)


def poisoned_outputs(b: int, n: int, device) -> list[torch.Tensor]:
    return [torch.full((b, n), -77, dtype=torch.int64, device=device),
            torch.full((b, n), -77, dtype=torch.int32, device=device),
            torch.full((b, n), -77, dtype=torch.int32, device=device),
            torch.full((b, n), -77, dtype=torch.int64, device=device),
            torch.full((b, n, mask_words(n)), -77, dtype=torch.int64, device=device)]


def check_end_to_end(logits: torch.Tensor, topk: int, budget: int, seed: int, dtype=torch.float32,
                     workspace: bool = False) -> dict:
    """Runs the kernels and the reference on the same logits; returns a summary with `ok`.  workspace: also
    through a poisoned caller's workspace of a larger capacity, which must give the same five outputs."""
    from plugins.tree_build.kernel import tree_build_triton
    from plugins.tree_build.workspace import TreeBuildWorkspace
    b, depth, vocab = logits.shape
    logits = logits.to(dtype)
    gen = torch.Generator().manual_seed(seed)
    root = torch.randint(0, vocab, (b,), generator=gen).to(logits.device)
    start = torch.randint(0, 10_000, (b,), generator=gen).to(logits.device)
    if seed % 2:  # the round passes the cache's int32 lengths as they are
        start = start.to(torch.int32)
    outs = poisoned_outputs(b, budget + 1, logits.device)
    scores = torch.full((b, budget + 1), float("nan"), device=logits.device)
    ws = tree_build_triton(logits, root, start, topk, *outs, scores=scores)
    k = min(topk, vocab)
    lp, ids = topk_logprobs_reference(logits, k)
    kk = ws.k
    lp_ok = torch.equal(ws.lp.view(b, depth, kk).cpu(), lp[..., :kk].cpu())
    ids_ok = torch.equal(ws.ids.view(b, depth, kk).long().cpu(), ids[..., :kk].cpu())
    ref = build_from_topk_reference(lp, ids, budget, root, start)
    names = ("tokens", "parents", "depth", "positions", "mask", "scores")
    bad = [name for name, o, r in zip(names, outs + [scores], ref) if not torch.equal(o.cpu(), r.cpu())]
    if workspace:
        big = TreeBuildWorkspace.allocate(b + 1, depth + 1, vocab + 5, budget + 3, topk + 2, logits.device)
        big.buffer.fill_(0xFF)  # NaN floats, -1 ints: whatever the kernels read before writing shows
        again = poisoned_outputs(b, budget + 1, logits.device)
        tree_build_triton(logits, root, start, topk, *again, workspace=big.buffer)
        bad += [name + " (workspace)" for name, o, r in zip(names, again, outs) if not torch.equal(o, r)]
    return {"b": b, "D": depth, "V": vocab, "B": budget, "topk": topk, "dtype": str(dtype).split(".")[-1],
            "stage1_ok": lp_ok and ids_ok, "bad_outputs": bad, "ok": lp_ok and ids_ok and not bad}


def check_stage2(lp: np.ndarray, budget: int, seed: int, device="cpu") -> dict:
    """Stage 2 alone on crafted sorted candidates lp [D, K] (one request)."""
    from plugins.tree_build.tree_kernel import build_tree_triton
    from plugins.tree_build.workspace import TreeBuildWorkspace
    depth, k = lp.shape
    rng = random.Random(seed)
    ids = torch.tensor([rng.sample(range(1000), k) for _ in range(depth)], dtype=torch.int64)[None]  # [1, D, K]
    lpt = torch.from_numpy(lp)[None]  # [1, D, K]
    ws = TreeBuildWorkspace.allocate(1, depth, 1000, budget, k, device)
    kk = ws.k
    ws.lp.copy_(lpt[0, :, :kk].to(device))
    ws.ids.copy_(ids[0, :, :kk].to(device))
    root, start = torch.tensor([5], device=device), torch.tensor([17], device=device)
    outs = poisoned_outputs(1, budget + 1, device)
    scores = torch.full((1, budget + 1), float("nan"), device=device)
    build_tree_triton(ws.lp, ws.ids, root, start, *outs, ws, scores)
    ref = build_from_topk_reference(lpt, ids, budget, root.cpu(), start.cpu())
    names = ("tokens", "parents", "depth", "positions", "mask", "scores")
    bad = [name for name, o, r in zip(names, outs + [scores], ref) if not torch.equal(o.cpu(), r.cpu())]
    return {"D": depth, "K": k, "B": budget, "ok": not bad, "bad_outputs": bad}


def check_prefix_closed(logits: torch.Tensor, big: int, smalls: tuple[int, ...], kernel: bool) -> list[str]:
    """Trees of budget `big` and each of `smalls` (topk = budget, as DDTree), through the kernels or the
    registered op; the mismatches of the big tree's first b + 1 nodes (all six outputs) against the tree of b."""
    from plugins.tree_build import tree_build as build
    if kernel:
        from plugins.tree_build.kernel import tree_build_triton as build
    b = logits.shape[0]
    root, start = torch.arange(b, device=logits.device) + 3, torch.arange(b, device=logits.device) * 10

    def tree(budget: int) -> list[torch.Tensor]:
        outs = poisoned_outputs(b, budget + 1, logits.device)
        scores = torch.full((b, budget + 1), float("nan"), device=logits.device)
        build(logits, root, start, budget, *outs, scores=scores)
        return outs + [scores]

    full, bad = tree(big), []
    for small in smalls:
        n = small + 1
        cut = [t[:, :n] for t in full[:4]] + [full[4][:, :n, :mask_words(n)], full[5][:, :n]]
        names = ("tokens", "parents", "depth", "positions", "mask", "scores")
        bad += [f"B {big} -> b {small}: {name}" for name, x, y in zip(names, cut, tree(small))
                if not torch.equal(x, y)]
        if full[4][:, :n, mask_words(n):].any():
            bad.append(f"B {big} -> b {small}: mask words beyond the prefix")
    return bad


def _interpreter_cases() -> list[tuple]:
    """(kind, args) small enough for the interpreter: V <= 300, B <= 40, D <= 5, b <= 2."""
    cases = [
        ("e2e", 2, 3, 100, 12, 12, "quant", torch.float32),
        ("e2e", 1, 4, 37, 30, 30, "few", torch.float32),
        ("e2e", 2, 2, 300, 40, 40, "randn", torch.float32),
        ("e2e", 1, 5, 64, 5, 1, "quant", torch.float32),       # chain: topk = 1
        ("e2e", 1, 3, 7, 30, 30, "quant", torch.float32),       # K = V < B
        ("e2e", 1, 3, 3, 39, 39, "few", torch.float32),         # B = every prefix (3 + 9 + 27)
        ("e2e", 1, 2, 200, 33, 40, "masked", torch.float32),
        ("e2e", 1, 3, 150, 20, 20, "peaked", torch.bfloat16),
        ("e2e", 1, 1, 90, 17, 40, "quant", torch.float32),      # depth 1, topk > B
        ("e2e", 1, 4, 2, 1, 2, "randn", torch.float32),         # B = 1
    ]
    cases += [("s2", ABSORPTION_LP, budget) for budget in (20, 22, 24)]
    cases.append(("prefix", 2, 3, 40, 12, (1, 5)))
    rng = random.Random(1234)
    for case in range(6):
        depth, k = rng.randint(2, 5), rng.randint(2, 8)
        total = sum(k ** d for d in range(1, depth + 1))
        cases.append(("s2", random_lp(rng, depth, k, (0, 2, 3, 2)[case % 4]), rng.randint(1, min(total, 40))))
    return cases


def interpreter_worker() -> list[dict]:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    results = []
    for i, case in enumerate(_interpreter_cases()):
        if case[0] == "e2e":
            _, b, depth, vocab, budget, topk, mode, dtype = case
            rng, gen = random.Random(i), torch.Generator().manual_seed(i)
            logits = make_logits(rng, gen, b, depth, vocab, mode, "cpu")
            res = check_end_to_end(logits, topk, budget, seed=i, dtype=dtype, workspace=i in (3, 4))
            res["mode"] = mode
        elif case[0] == "prefix":
            _, b, depth, vocab, big, smalls = case
            logits = (torch.randn(b, depth, vocab, generator=torch.Generator().manual_seed(i)) * 2).round() / 2
            bad = check_prefix_closed(logits, big, smalls, kernel=True)
            res = {"B": big, "b": list(smalls), "ok": not bad, "bad_outputs": bad}
        else:
            _, lp, budget = case
            res = check_stage2(lp, budget, seed=i)
        res["case"] = i
        results.append(res)
    return results


def test_triton_kernels_interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--interpret"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    failed = [r for r in results if not r["ok"]]
    assert len(results) == len(_interpreter_cases()) and not failed, failed


def test_op_with_workspace_is_the_op_without():
    """The registered op on CPU (the reference) takes a caller's workspace of a larger capacity and gives the
    same outputs; a workspace too small for the call is one ValueError naming the call's shapes."""
    from plugins.tree_build import TreeBuildWorkspace, tree_build
    gen = torch.Generator().manual_seed(5)
    b, depth, vocab, budget = 2, 3, 40, 12
    logits = torch.randn(b, depth, vocab, generator=gen)
    root, start = torch.tensor([3, 7]), torch.tensor([10, 0])
    want, got = poisoned_outputs(b, budget + 1, "cpu"), poisoned_outputs(b, budget + 1, "cpu")
    tree_build(logits, root, start, budget, *want)
    ws = TreeBuildWorkspace.allocate(4, 8, 100, 64, 64, "cpu")
    tree_build(logits, root, start, budget, *got, workspace=ws.buffer)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    small = TreeBuildWorkspace.allocate(1, depth, vocab, budget, budget, "cpu")
    with pytest.raises(ValueError, match=r"tree_build: workspace holds \d+ bytes, this call \(b 2, D 3, V 40"):
        tree_build(logits, root, start, budget, *got, workspace=small.buffer)


# ---------------------------------------------------------------------------------------------------
# GPU

def _gpu_shapes(n_shapes: int = 240) -> list[dict]:
    """Random shapes from menus (bounded number of kernel compilations)."""
    rng = random.Random(2026)
    budgets = [1, 5, 16, 64, 200, 256, 1024]
    vocabs = [50, 4099, 163840]
    depths = [1, 3, 6, 7, 8, 13, 16]
    modes = ["randn", "quant", "few", "peaked", "masked"]
    shapes = []
    while len(shapes) < n_shapes:
        budget, vocab, depth = rng.choice(budgets), rng.choice(vocabs), rng.choice(depths)
        b = rng.choice([1, 1, 2, 3, 8, 16])
        if budget == 1024 and vocab == 163840:
            b = min(b, 4)
        topk = budget
        if budget <= 64 and rng.random() < 0.3:  # chains and K < B (each K is another kernel variant)
            topk = rng.choice([1, max(1, budget // 3)])
        if sum(min(topk, vocab) ** d for d in range(1, depth + 1)) < budget:
            continue
        shapes.append(dict(b=b, D=depth, V=vocab, B=budget, topk=topk, mode=rng.choice(modes),
                           dtype=rng.choice([torch.float32, torch.float32, torch.bfloat16]),
                           start32=len(shapes) % 2 == 1))  # check_end_to_end's start dtype for seed = the index
    return shapes


def _variant_keys(s: dict) -> tuple[tuple, tuple]:
    """What decides the kernels a shape compiles (the request count b does not): (tree kernel key, stage-1
    key): the workspace's pads and Triton's integer specialisations of the sizes each kernel receives, the start
    lengths' dtype (a pointer's type is part of the tree kernel's signature), and the logits dtype (the workspace
    is allocated on the meta device: sizes only).  Every check passes scores (HAS_SCORES), as warm_worker does."""
    from compile_warmup import int_spec
    from plugins.common.bitmask import mask_words
    from plugins.tree_build.workspace import TreeBuildWorkspace
    ws = TreeBuildWorkspace.allocate(1, s["D"], s["V"], s["B"], s["topk"], "meta")
    tree = (ws.b_pad, ws.p_pad, ws.d_pad, *map(int_spec, (ws.k, s["B"], s["D"], mask_words(s["B"] + 1))),
            s["start32"])
    stage1 = (ws.chunk, ws.chunks, ws.k, *map(int_spec, (s["V"], ws.chunks, ws.k)), str(s["dtype"]))
    return tree, stage1


def _warm_groups(shapes: list[dict]) -> tuple[list[list[dict]], list[int]]:
    """b = 1 cases covering every kernel variant of the shapes, grouped by tree-kernel variant (one group runs
    in one process, so no variant compiles twice at once), and each group's cost (its candidate pad P_PAD:
    the tree kernel's compile time grows with it)."""
    groups: dict[tuple, list[dict]] = {}
    seen_stage1 = set()
    for s in shapes:
        tree, stage1 = _variant_keys(s)
        if tree not in groups or stage1 not in seen_stage1:
            groups.setdefault(tree, []).append(dict(s, b=1, dtype=str(s["dtype"]).split(".")[-1]))
            seen_stage1.add(stage1)
    return list(groups.values()), [tree[1] for tree in groups]


def warm_worker(cases: list[dict]) -> None:
    """Launches each case once on CUDA as check_end_to_end does (scores on, the case's start dtype), which compiles
    its kernels into Triton's cache; no checks."""
    from plugins.tree_build.kernel import tree_build_triton
    for c in cases:
        logits = torch.randn(1, c["D"], c["V"], device="cuda").to(getattr(torch, c["dtype"]))
        root = torch.zeros(1, dtype=torch.int64, device="cuda")
        start = root.to(torch.int32 if c["start32"] else torch.int64)
        scores = torch.zeros(1, c["B"] + 1, device="cuda")
        tree_build_triton(logits, root, start, c["topk"], *poisoned_outputs(1, c["B"] + 1, "cuda"), scores=scores)
    torch.cuda.synchronize()


def _write_device_summary(results: list[dict], t0: float, done: bool, warmed: dict) -> dict:
    """$KDTREE_RESULTS_DIR/tree_build-device-test.json, rewritten as the run goes (a run cut short by a
    time limit still leaves what it checked, with complete = false)."""
    failed = [r for r in results if not r["ok"]]
    summary = {"op": "tree_build", "complete": done, "shapes_checked": len(results), "failed": len(failed),
               "exact": "all six outputs (scores included) and the stage-1 lp/ids compared with torch.equal",
               "seconds": round(time.time() - t0, 1), "compile_warmup": warmed, "failures": failed[:20],
               "shapes": results}
    out_dir = os.environ.get("KDTREE_RESULTS_DIR")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "tree_build-device-test.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


@pytest.mark.gpu
def test_tree_build_kernel_gpu():
    from compile_warmup import warm
    t0 = time.time()
    shapes = _gpu_shapes(int(os.environ.get("KDTREE_TREE_BUILD_SHAPES", gpu_cases(240))))
    warmed = warm(Path(__file__), *_warm_groups(shapes))
    results = []
    for i, s in enumerate(shapes):
        rng, gen = random.Random(i), torch.Generator().manual_seed(i)
        logits = make_logits(rng, gen, s["b"], s["D"], s["V"], s["mode"], "cuda")
        res = check_end_to_end(logits, s["topk"], s["B"], seed=i, dtype=s["dtype"])
        res.update(mode=s["mode"], case=i, seconds=round(time.time() - t0, 1))
        results.append(res)
        if i % 10 == 9:
            _write_device_summary(results, t0, False, warmed)
    torch.cuda.synchronize()
    for i, budget in enumerate((20, 22, 24)):
        res = check_stage2(ABSORPTION_LP, budget, seed=i, device="cuda")
        res.update(case=f"absorption-{budget}")
        results.append(res)
    summary = _write_device_summary(results, t0, True, warmed)
    print(f"tree_build GPU: {len(results)} shapes, {summary['failed']} failed, {summary['seconds']} s")
    assert not summary["failed"], summary["failures"][:5]

if __name__ == "__main__":
    if "--interpret" in sys.argv:
        print(json.dumps(interpreter_worker()))
    elif "--warm" in sys.argv:
        warm_worker(json.loads(sys.argv[sys.argv.index("--warm") + 1]))
