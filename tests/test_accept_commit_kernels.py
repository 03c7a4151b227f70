"""tree_accept and kv_commit kernels (plugins/*/kernel.py) against their references.

CPU: the Triton launchers run under TRITON_INTERPRET=1 in a subprocess (the interpreter is chosen
when a kernel module is imported, so it must not leak into other test modules), on tiny shapes.
GPU (-m gpu): hundreds of random shapes per op, poisoned outputs, untouched slots/rows, CUDA-graph
replay, the registered ops dispatching to the kernels; a JSON summary per op goes to
$KDTREE_RESULTS_DIR when set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from gpu_cases import gpu_cases
from interpreter import interpreted

from plugins.kv_commit.reference import kv_commit_reference
from plugins.tree_accept.reference import tree_accept_reference
from plugins.tree_build import build_from_topk_reference, topk_logprobs_reference

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------- cases

def random_tree(g: torch.Generator, b: int, depth: int, vocab: int, budget: int, chain: bool = False):
    """tokens [b, N] int64, parents [b, N] int32 from the tree_build reference on random draft logits."""
    logits = torch.randn(b, depth, vocab, generator=g) * 3
    k = 1 if chain else min(budget, vocab)
    lp, ids = topk_logprobs_reference(logits, k)
    root = torch.randint(0, vocab, (b,), generator=g)
    tokens, parents, *_ = build_from_topk_reference(lp, ids, budget, root, torch.zeros(b, dtype=torch.long))
    return tokens, parents


def random_posterior(g: torch.Generator, tokens: torch.Tensor, parents: torch.Tensor, vocab: int,
                     mode: str) -> torch.Tensor:
    """posterior [b, N] int64: 'random' tokens, or 'planted' along the path to a random (or the last) node."""
    b, n = tokens.shape
    post = torch.randint(0, vocab, (b, n), generator=g)
    if mode == "random":
        return post
    for r in range(b):
        j = n - 1 if mode == "deepest" else int(torch.randint(0, n, (1,), generator=g))
        while j > 0:
            p = int(parents[r, j])
            post[r, p] = tokens[r, j]
            j = p
    return post


def tree_accept_expected(posterior, tokens, parents, a):
    """The reference's outputs with the kernel's device-side cap at a path nodes, and how many walks hit the cap."""
    b, n = tokens.shape
    idx = torch.full((b, n), -7, dtype=torch.int32)
    length = torch.zeros(b, dtype=torch.int32)
    bonus = torch.zeros(b, dtype=torch.long)
    tree_accept_reference(posterior.cpu(), tokens.cpu(), parents.cpu(), idx, length, bonus)
    capped = length > a
    for r in torch.nonzero(capped).flatten().tolist():
        bonus[r] = posterior[r, int(idx[r, a - 1])]
    length = torch.clamp(length, max=a)
    out = torch.full((b, a), -7, dtype=torch.int32)
    for r in range(b):
        out[r, : int(length[r])] = idx[r, : int(length[r])]
    return out, length, bonus, int(capped.sum())


def tree_accept_case(g: torch.Generator, small: bool):
    b = int(torch.randint(1, 4 if small else 65, (1,), generator=g))
    depth = int(torch.randint(1, 6 if small else 17, (1,), generator=g))
    vocab = int(torch.randint(2, 12 if small else 64, (1,), generator=g))
    chain = bool(torch.rand(1, generator=g) < 0.2)
    if chain:
        budget = depth
    else:
        total = sum(vocab ** d for d in range(1, depth + 1))  # prefixes available (K = min(budget, vocab))
        hi = min(total, 24 if small else 1024)
        budget = int(torch.randint(1, hi + 1, (1,), generator=g)) if small or torch.rand(1, generator=g) < 0.5 \
            else int(2 ** (torch.rand(1, generator=g) * 10.01)) % hi + 1  # log-uniform 1..1024
        if not small:
            b = max(1, min(b, 8192 // budget))
    tokens, parents = random_tree(g, b, depth, vocab, budget, chain)
    mode = ["random", "planted", "deepest"][int(torch.randint(0, 3, (1,), generator=g))]
    posterior = random_posterior(g, tokens, parents, vocab, mode)
    r = float(torch.rand(1, generator=g))
    a = depth + 1 if r < 0.6 else depth + 4 if r < 0.8 else max(1, depth - 1)  # exact, slack, capped
    return posterior, tokens, parents, a, dict(b=b, n=budget + 1, depth=depth, vocab=vocab, a=a, mode=mode,
                                              chain=chain)


def run_tree_accept_case(fn, posterior, tokens, parents, a, device):
    b, n = tokens.shape
    idx = torch.full((b, a), -7, dtype=torch.int32, device=device)
    length = torch.full((b,), -1, dtype=torch.int32, device=device)
    bonus = torch.full((b,), -1, dtype=torch.long, device=device)
    fn(posterior.to(device), tokens.to(device), parents.to(device), idx, length, bonus)
    *want, capped = tree_accept_expected(posterior, tokens, parents, a)
    got = (idx.cpu(), length.cpu(), bonus.cpu())
    return all(torch.equal(x, w) for x, w in zip(got, want)), int(want[1].max()), capped


def kv_commit_case(g: torch.Generator, small: bool, dtype: torch.dtype):
    """Random kv_commit inputs on g's device (cache rows random, ctx_feats poisoned with NaN); accept_len
    0..a and cache_lens leaving room for the accepted rows (the reference indexes out of range otherwise)."""
    dev = g.device

    def pick(options):
        return options[int(torch.randint(0, len(options), (1,), generator=g, device=dev))]

    def randint(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=g, device=dev))

    b, y = (randint(1, 4), randint(1, 4)) if small else (pick([1, 2, 3, 8, 17, 64, 200]), pick([1, 2, 7, 61]))
    d = pick([5, 8, 16, 72, 576]) if small else pick([576, 576, 512, 64, 72, 100, 1, 13])
    n = randint(1, 10) if small else pick([1, 2, 9, 17, 65, 257])
    a = randint(1, 6) if small else randint(1, 18)
    l_max = randint(a, a + 12) if small else randint(a, a + min(300, 30_000_000 // (y * b * d) + 1))
    f = pick([0, 0, 3, 16, 40]) if small else pick([0, 7168 * 6 // 8, 4097, 1, 0])
    cache = torch.randn(y, b, l_max, d, generator=g, device=dev).to(dtype)
    scratch = torch.randn(y, b, n, d, generator=g, device=dev).to(dtype)
    accept_len = torch.randint(0, a + 1, (b,), generator=g, device=dev, dtype=torch.int32)
    lens = (torch.rand(b, generator=g, device=dev) * (l_max - accept_len + 1).float()).to(torch.int32)
    nf = randint(1, n + 1) if f else n
    accept_idx = torch.randint(0, nf, (b, a), generator=g, device=dev, dtype=torch.int32)
    feats = torch.randn(b, nf, f, generator=g, device=dev).to(dtype) if f else None
    ctx = torch.full((b, a, f), float("nan"), device=dev).to(dtype) if f else None
    return (cache, lens, scratch, accept_idx, accept_len, feats, ctx), dict(y=y, b=b, l_max=l_max, n=n, d=d, a=a, f=f)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def run_kv_commit_case(fn, args, **kw):
    """Runs fn and the reference (on clones, same device); bitwise comparison of every output (advance=False in kw:
    the lengths stay)."""
    ref = [t.clone() if t is not None else None for t in args]
    fn(*args, **kw)
    kv_commit_reference(*ref, advance=kw.get("advance", True))
    checks = [(args[0], ref[0]), (args[1], ref[1])] + ([(args[6], ref[6])] if args[5] is not None else [])
    return all(torch.equal(_bits(x), _bits(w)) for x, w in checks)


# ------------------------------------------------------------------------------ CPU, Triton interpreter

def _interpreter_checks() -> dict:
    """Runs in the subprocess with TRITON_INTERPRET=1: tiny shapes through the Triton launchers."""
    from plugins.kv_commit.kernel import kv_commit_triton
    from plugins.tree_accept.kernel import tree_accept_triton
    g = torch.Generator().manual_seed(1234)
    out: dict = {"tree_accept": [], "kv_commit": []}
    for _ in range(40):
        post, tok, par, a, meta = tree_accept_case(g, small=True)
        ok, longest, capped = run_tree_accept_case(tree_accept_triton, post, tok, par, a, "cpu")
        out["tree_accept"].append(dict(meta, ok=ok, longest=longest, capped=capped))
    # hand-made: duplicate sibling tokens (the first child wins) and out-of-range parents never match
    tok = torch.tensor([[1, 5, 5, 6, 7]])
    par = torch.tensor([[-1, 0, 0, 2, 9]], dtype=torch.int32)
    post = torch.tensor([[5, 6, 6, 3, 4]])
    ok, _, _ = run_tree_accept_case(tree_accept_triton, post, tok, par, 4, "cpu")
    out["tree_accept"].append(dict(case="duplicates", ok=ok))
    for i in range(24):
        args, meta = kv_commit_case(g, small=True, dtype=torch.float32 if i % 2 else torch.bfloat16)
        kw = dict(layers_per_program=[1, 2, 8][i % 3], feats_per_program=16, advance=i % 4 != 3)
        out["kv_commit"].append(dict(meta, ok=run_kv_commit_case(kv_commit_triton, args, **kw)))
    out["kv_commit"].append(dict(case="capacity guard", ok=_capacity_guard(kv_commit_triton, "cpu")))
    many = _many_requests("cpu")  # cache_lens of > ADVANCE_BLOCK requests: several advance programs
    out["kv_commit"].append(dict(case="300 requests", ok=run_kv_commit_case(kv_commit_triton, many)))
    out["posterior"] = _posterior_checks("cpu", rows=100, block_v=32)
    out["posterior"] += _posterior_request_sweep("cpu", 10, 1234, block_v=32, max_elements=20_000)
    return out


def _posterior_checks(device: str, rows: int, block_v: int) -> list[dict]:
    """greedy against torch.argmax (ties included, odd V, several blocks; state untouched); sampled, a
    chi-square goodness of fit of rows samples of one distribution against softmax(logits * inv_temp) in
    float64, fresh draws per call, the same draws as plugins.common.rng.choose on the CPU (the op's CPU
    path) from the same per-request (seed, counter) on fresh random logits, with inv_temp read from device
    memory, and each request's draws in a batch equal to its draws alone."""
    from scipy.stats import chisquare

    from plugins.tree_accept.posterior import posterior_reference, posterior_triton
    g = torch.Generator(device=device).manual_seed(99)
    out = []
    for b, n, v, dtype in ((2, 3, 5, torch.float32), (1, 7, 37, torch.bfloat16), (3, 2, 300, torch.float16),
                           (2, 5, 163840 if device == "cuda" else 100, torch.bfloat16)):
        logits = torch.randint(-3, 3, (b, n, v), generator=g, device=device).to(dtype)  # many exact ties
        got = torch.full((b, n), -1, dtype=torch.long, device=device)
        state = torch.tensor([[3, 8]] * b, dtype=torch.long, device=device)
        posterior_triton(logits, True, state, torch.ones(b, device=device), got, block_v=block_v)
        out.append(dict(case=f"greedy {b}x{n}x{v} {dtype}", ok=torch.equal(got, logits.argmax(-1))
                        and state.tolist() == [[3, 8]] * b))
    # the non-finite flag: set for a request with a NaN / +Inf / -Inf among its logits, left as it was otherwise
    # (1 stays 1: its reader clears it), the tokens of the finite rows unchanged
    for greedy in (True, False):
        logits = torch.randn(4, 3, 40, generator=g, device=device)
        logits[1, 2, 7], logits[2, 0, 39], logits[3, 1, 0] = float("nan"), float("inf"), float("-inf")
        flag = torch.tensor([0, 0, 0, 0], dtype=torch.long, device=device)
        flag_before = torch.tensor([1, 0, 0, 0], dtype=torch.long, device=device)
        state = torch.tensor([[3, 8]] * 4, dtype=torch.long, device=device)
        got = torch.full((4, 3), -1, dtype=torch.long, device=device)
        posterior_triton(logits, greedy, state.clone(), torch.ones(4, device=device), got, block_v=block_v,
                         nonfinite=flag)
        posterior_triton(logits[:1], greedy, state[:1].clone(), torch.ones(1, device=device), got[:1],
                         block_v=block_v, nonfinite=flag_before[:1])
        plain = torch.full((4, 3), -1, dtype=torch.long, device=device)
        posterior_triton(logits, greedy, state.clone(), torch.ones(4, device=device), plain, block_v=block_v)
        out.append(dict(case=f"nonfinite flag greedy={greedy}", ok=flag.tolist() == [0, 1, 1, 1]
                        and flag_before.tolist() == [1, 0, 0, 0] and torch.equal(got[0], plain[0])))
    for v, temp in ((6, 1.0), (17, 0.7)):
        logits = torch.randn(v, generator=g, device=device) * 1.5
        state = torch.tensor([[1234, 0]], dtype=torch.long, device=device)  # one request of `rows` rows
        inv_temp = torch.tensor([1 / temp], dtype=torch.float32, device=device)
        got = torch.full((1, rows), -1, dtype=torch.long, device=device)
        posterior_triton(logits.expand(1, rows, v), False, state, inv_temp, got, block_v=block_v)
        again = got.clone()
        posterior_triton(logits.expand(1, rows, v), False, state, inv_temp, again, block_v=block_v)
        probs = torch.softmax(logits.double().cpu() / temp, -1)
        counts = torch.bincount(torch.cat([got[0], again[0]]).cpu(), minlength=v).double()
        p_value = float(chisquare(counts.numpy(), (probs * 2 * rows).numpy()).pvalue)
        out.append(dict(case=f"sample V={v} T={temp}", p_value=p_value, ok=p_value > 1e-4
                        and state.tolist() == [[1234, 2]] and not torch.equal(got, again)))
    # the same samples as the CPU path: uniforms bit-identical, race values equal up to log's last bits; one
    # inv_temp tensor rewritten in place between calls (as the round does for a new T); requests of one batch
    # with their own seeds, counters and temperatures, each drawing as it would alone
    for b, n, v, dtype, temp, seed in ((3, 5, 7, torch.float32, 1.0, 5), (2, 9, 300, torch.bfloat16, 0.6, -3),
                                       (4, 17, 163840 if device == "cuda" else 1000, torch.bfloat16, 1.0, 2 ** 62),
                                       (5, 3, 50, torch.float16, 2.5, 77)):
        logits = (torch.randn(b, n, v, generator=g, device=device) * 3).to(dtype)
        inv_temp = torch.tensor([1 / (temp * (1 + 0.25 * r)) for r in range(b)], dtype=torch.float32, device=device)
        start = [[seed - r, 41 + 3 * r] for r in range(b)]
        state = torch.tensor(start, dtype=torch.long, device=device)
        got = torch.full((b, n), -1, dtype=torch.long, device=device)
        posterior_triton(logits, False, state, inv_temp, got, block_v=block_v)
        cpu_state = torch.tensor(start, dtype=torch.long)
        want = posterior_reference(logits.cpu(), False, cpu_state, inv_temp.cpu())
        same = float((got.cpu() == want).double().mean())
        out.append(dict(case=f"same draws as CPU {b}x{n}x{v} T={temp}", agreement=same,
                        ok=same >= 0.95 and state.tolist() == cpu_state.tolist() == [[s, c + 1] for s, c in start]))
        alone = torch.full((b, n), -1, dtype=torch.long, device=device)
        for r in range(b):
            one = torch.tensor([start[r]], dtype=torch.long, device=device)
            posterior_triton(logits[r:r + 1], False, one, inv_temp[r:r + 1], alone[r:r + 1], block_v=block_v)
        out.append(dict(case=f"each request draws as alone {b}x{n}x{v}", ok=torch.equal(alone, got)))
    return out


def _posterior_request_sweep(device: str, cases: int, seed: int, block_v: int, max_elements: int) -> list[dict]:
    """Random batches of requests, each with its own (seed, counter) (any int64) and temperature: logits
    [b, N, V] (the verify) or [b, V] (an AR step), b, N and V awkward, fp32/bf16/fp16.  The kernel's draws
    agree with the CPU path's (>= 95 %: log's last bits may flip a near-tie), every request's counter
    advances by one and its seed stays, and each request's draws in the batch equal its draws launched
    alone (bit for bit: the same kernel on the same row)."""
    from plugins.tree_accept.posterior import posterior_reference, posterior_triton
    g = torch.Generator(device="cpu").manual_seed(seed)

    def pick(xs: list):
        return xs[int(torch.randint(len(xs), (1,), generator=g))]

    out = []
    for _ in range(cases):
        b = pick([1, 2, 3, 5, 8, 13])
        n = pick([None, 1, 2, 9, 17, 61])
        v = pick([1, 7, 100, 1000, 4097, 32003, 163840])
        while b * (n or 1) * v > max_elements and v > 1:
            v = max(1, v // 3)
        dtype = pick([torch.float32, torch.bfloat16, torch.float16])
        shape = (b, v) if n is None else (b, n, v)
        logits = (torch.randn(shape, generator=g) * 4).to(dtype).to(device)
        start = torch.randint(-2 ** 63, 2 ** 63 - 1, (b, 2), generator=g)  # any seed, any counter
        start[:, 1] = start[:, 1].clamp(max=2 ** 62)  # far from the counter's wrap
        inv_temp = (1 / (0.2 + 4 * torch.rand(b, generator=g))).to(device)  # T in (0.2, 4.2)
        state = start.clone().to(device)  # (a copy: on the CPU .to would alias start)
        got = torch.full(shape[:-1], -1, dtype=torch.long, device=device)
        posterior_triton(logits, False, state, inv_temp, got, block_v=block_v)
        cpu_state = start.clone()
        want = posterior_reference(logits.cpu(), False, cpu_state, inv_temp.cpu())
        advanced = start + torch.tensor([0, 1])
        alone = torch.full_like(got, -1)
        for r in range(b):
            posterior_triton(logits[r:r + 1], False, start[r:r + 1].clone().to(device), inv_temp[r:r + 1],
                             alone[r:r + 1], block_v=block_v)
        same = float((got.cpu() == want).double().mean())
        out.append(dict(case=f"per-request {list(shape)} {dtype}", agreement=same, alone=torch.equal(alone, got),
                        ok=same >= 0.95 and torch.equal(alone, got) and torch.equal(state.cpu(), advanced)
                        and torch.equal(cpu_state, advanced)))
    return out


def _many_requests(device: str):
    g = torch.Generator(device=device).manual_seed(5)
    b, a = 300, 3
    alen = torch.randint(0, a + 1, (b,), generator=g, device=device, dtype=torch.int32)
    idx = torch.randint(0, 4, (b, a), generator=g, device=device, dtype=torch.int32)
    lens = torch.randint(0, 3, (b,), generator=g, device=device, dtype=torch.int32)
    return (torch.randn(1, b, 6, 3, generator=g, device=device), lens,
            torch.randn(1, b, 4, 3, generator=g, device=device), idx, alen, None, None)


def _capacity_guard(fn, device) -> bool:
    """Rows past l_max are skipped (the reference would index out of range); cache_lens still advances."""
    cache = torch.randn(2, 2, 6, 8, device=device)
    before = cache.clone()
    scratch = torch.randn(2, 2, 4, 8, device=device)
    lens = torch.tensor([4, 1], dtype=torch.int32, device=device)
    idx = torch.tensor([[3, 1, 2], [0, 2, 1]], dtype=torch.int32, device=device)
    fn(cache, lens, scratch, idx, torch.tensor([3, 2], dtype=torch.int32, device=device))
    want = before.clone()
    want[:, 0, 4:6] = scratch[:, 0, [3, 1]]
    want[:, 1, 1:3] = scratch[:, 1, [0, 2]]
    return torch.equal(cache, want) and lens.tolist() == [7, 3]


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    return interpreted(__file__, timeout=300)


@pytest.mark.parametrize("op", ["tree_accept", "kv_commit", "posterior"])
def test_kernel_matches_reference_in_interpreter(interpreter_results, op):
    bad = [c for c in interpreter_results[op] if not c["ok"]]
    assert not bad, f"{op}: {len(bad)} of {len(interpreter_results[op])} cases differ: {bad[:5]}"
    if op == "tree_accept":  # the cases must include long accepts and walks cut at the capacity
        assert max(c.get("longest", 0) for c in interpreter_results[op]) >= 4
        assert sum(c.get("capped", 0) for c in interpreter_results[op]) >= 1


def test_static_checks_raise_value_errors():
    pytest.importorskip("triton")
    from plugins.kv_commit.kernel import check_kv_commit
    from plugins.tree_accept.kernel import check_tree_accept
    tok = torch.zeros(2, 5, dtype=torch.long)
    par = torch.zeros(2, 5, dtype=torch.int32)
    with pytest.raises(ValueError, match="parents"):
        check_tree_accept(tok, tok, par.long(), torch.zeros(2, 3, dtype=torch.int32), par[:, 0], tok[:, 0])
    with pytest.raises(ValueError, match="accept_idx"):
        check_tree_accept(tok, tok, par, torch.zeros(2, 3, dtype=torch.long), par[:, 0], tok[:, 0])
    cache = torch.zeros(2, 2, 8, 4)
    lens = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="scratch"):
        check_kv_commit(cache, lens, torch.zeros(2, 2, 3, 5), torch.zeros(2, 3, dtype=torch.int32), lens, None, None)
    with pytest.raises(ValueError, match="ctx_feats"):
        check_kv_commit(cache, lens, torch.zeros(2, 2, 3, 4), torch.zeros(2, 3, dtype=torch.int32), lens,
                        torch.zeros(2, 3, 6), torch.zeros(2, 2, 6))


def test_posterior_cpu_op_is_choose():
    """The registered op on CPU is plugins.common.rng.choose, draws and state advance included."""
    from plugins.common.rng import choose
    from plugins.tree_accept.posterior import posterior
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 4, 50, generator=g)  # [b, N, V]
    inv_temp = torch.tensor([1 / 0.7, 1.0, 2.0])
    for greedy in (True, False):
        state, want_state = torch.tensor([[9, 2], [9, 5], [-4, 0]]), torch.tensor([[9, 2], [9, 5], [-4, 0]])
        out = torch.full((3, 4), -1, dtype=torch.long)
        posterior(logits, greedy, state, inv_temp, out)
        assert torch.equal(out, choose(logits, greedy, want_state, inv_temp)) and torch.equal(state, want_state)
        assert state[:, 1].tolist() == ([2, 5, 0] if greedy else [3, 6, 1])
    flag = torch.tensor([0, 1, 0])  # set where a logit is NaN / Inf, left as it was elsewhere
    bad = logits.clone()
    bad[2, 3, 1] = float("inf")
    posterior(bad, True, state, inv_temp, out, flag)
    assert flag.tolist() == [0, 1, 1]
    with pytest.raises(ValueError, match="inv_temp must be contiguous torch.float32 \\[3\\]"):
        posterior(logits, False, state, torch.tensor([1.0, 2.0]), torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="state must be contiguous torch.int64 \\[3, 2\\]"):
        posterior(logits, False, torch.tensor([9, 2]), inv_temp, torch.zeros(3, 4, dtype=torch.long))


@pytest.mark.slow
def test_aot_kernels_compile_for_sm90(tmp_path):
    """plugins/{tree_accept,kv_commit}/aot.py through the build's Triton AOT step (its subprocess entry,
    without TRITON_INTERPRET), for sm_90: a cubin and a launcher record per specialisation, each waiting for its
    predecessor grid first (programmatic dependent launch)."""
    pytest.importorskip("triton")
    modules = ["plugins.tree_accept.aot", "plugins.kv_commit.aot"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    proc = subprocess.run([sys.executable, "-m", "build_pipeline.compile_kernels", "--out", str(tmp_path),
                           "--arch", "sm_90", "--budgets", "16,256", "--modules", ",".join(modules)],
                          env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    recs = json.loads(proc.stdout.strip().splitlines()[-1])
    names = sorted(r["name"] for r in recs)
    assert names == sorted(["tree_accept_b16", "tree_accept_b256", "posterior_bf16_argmax", "posterior_bf16_sample",
                            "posterior_fp32_argmax", "posterior_fp32_sample", "kv_commit_copy_d576_feats",
                            "kv_commit_copy_d576_nofeats", "kv_commit_advance"]), names
    for r in recs:
        meta = json.loads((tmp_path / r["meta"]).read_text())
        assert (tmp_path / r["cubin"]).read_bytes()[:4] == b"\x7fELF" and meta["target"][1] == 90, r
        # programmatic dependent launch compiled in: the wait on the predecessor grid (plugins/common/pdl.py)
        assert b"griddepcontrol.wait" in (tmp_path / r["ptx"]).read_bytes(), r


# ------------------------------------------------------------------------------------------------ GPU

def _write_summary(op: str, doc: dict) -> None:
    out = os.environ.get("KDTREE_RESULTS_DIR")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{op}-device-test.json").write_text(json.dumps(doc, indent=1) + "\n")


@pytest.mark.gpu
def test_tree_accept_kernel_on_gpu_many_shapes():
    from plugins.tree_accept import tree_accept
    g = torch.Generator().manual_seed(20261202)
    cases, t0 = [], time.time()
    for i in range(gpu_cases(240)):
        post, tok, par, a, meta = tree_accept_case(g, small=False)
        ok, longest, capped = run_tree_accept_case(tree_accept, post, tok, par, a, "cuda")  # the registered op
        cases.append(dict(meta, ok=ok, longest=longest, capped=capped))
    for n in (1, 2, 1025, 2049):  # edge sizes: root only, one node, B = 1024, beyond one 2048 block
        tok = torch.randint(0, 3, (3, n))
        par = (torch.randint(-1, max(n - 1, 1), (3, n), dtype=torch.int32)
               .minimum(torch.arange(n, dtype=torch.int32) - 1))
        post = torch.randint(0, 3, (3, n))
        for a in (1, 5, 64):
            ok, longest, capped = run_tree_accept_case(tree_accept, post, tok, par, a, "cuda")
            cases.append(dict(b=3, n=n, a=a, mode="random-parents", ok=ok, longest=longest, capped=capped))
    bad = [c for c in cases if not c["ok"]]
    _write_summary("tree_accept", dict(op="tree_accept", cases=len(cases), failed=len(bad), passed=not bad,
                                       max_accept_len=max(c["longest"] for c in cases),
                                       capped_walks=sum(c["capped"] for c in cases),
                                       max_n=max(c["n"] for c in cases), seconds=round(time.time() - t0, 1),
                                       first_failures=bad[:10]))
    assert not bad, f"{len(bad)} of {len(cases)} differ: {bad[:5]}"


@pytest.mark.gpu
def test_kv_commit_kernel_on_gpu_many_shapes():
    from plugins.kv_commit import kv_commit
    from plugins.kv_commit.kernel import kv_commit_triton
    g = torch.Generator(device="cuda").manual_seed(20261203)
    cases, t0 = [], time.time()
    for i in range(gpu_cases(240)):
        dtype = [torch.bfloat16, torch.bfloat16, torch.float16, torch.float32][i % 4]
        args, meta = kv_commit_case(g, small=False, dtype=dtype)
        if i % 3 == 0:
            ok = run_kv_commit_case(kv_commit, args)  # the registered op
        else:
            kw = dict(layers_per_program=[1, 4, 8, 16][i % 4], feats_per_program=[1024, 4096, 8192][i % 3],
                      num_warps=[2, 4, 8][i % 3], advance=i % 5 != 4)
            ok = run_kv_commit_case(kv_commit_triton, args, **kw)
        cases.append(dict(meta, dtype=str(dtype), ok=ok))
    cases.append(dict(case="capacity guard", y=2, f=0, ok=_capacity_guard(kv_commit_triton, "cuda")))
    cases.append(dict(case="300 requests", y=1, f=0, ok=run_kv_commit_case(kv_commit, _many_requests("cuda"))))
    bad = [c for c in cases if not c["ok"]]
    _write_summary("kv_commit", dict(op="kv_commit", cases=len(cases), failed=len(bad), passed=not bad,
                                     max_y=max(c["y"] for c in cases), max_f=max(c["f"] for c in cases),
                                     seconds=round(time.time() - t0, 1), first_failures=bad[:10]))
    assert not bad, f"{len(bad)} of {len(cases)} differ: {bad[:5]}"


@pytest.mark.gpu
def test_posterior_kernel_on_gpu_argmax_and_distribution():
    from plugins.tree_accept.posterior import posterior, posterior_reference
    t0 = time.time()
    cases = _posterior_checks("cuda", rows=400_000, block_v=4096)
    sweep_seed = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run; the summary names the seed
    cases += _posterior_request_sweep("cuda", 60, sweep_seed, block_v=4096, max_elements=8_000_000)
    # the registered op in a CUDA graph: every replay draws fresh samples, each request from its own row
    logits = torch.randn(4, 9, 1000, device="cuda")
    start = torch.tensor([[5, 0], [-9, 3], [5, 40], [2 ** 62, 1]], dtype=torch.long)
    state = start.to("cuda")  # a copy: start keeps the rows' first states
    inv_temp = torch.tensor([1.0, 0.5, 2.0, 1.3], dtype=torch.float32, device="cuda")
    out = torch.zeros(4, 9, dtype=torch.long, device="cuda")
    posterior(logits, False, state, inv_temp, out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        posterior(logits, False, state, inv_temp, out)
    draws = []
    for _ in range(3):
        graph.replay()
        draws.append(out.clone())
    fresh = not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])
    cases.append(dict(case="graph replay draws fresh samples",
                      ok=fresh and torch.equal(state.cpu(), start + torch.tensor([0, 4]))))
    inv_temp[2] = 1 / 0.3  # a new T for one request into the captured graph: its row samples softmax(logits / 0.3)
    state[1] = torch.tensor([77, 0])  # and a new request in row 1
    graph.replay()
    now = start + torch.tensor([0, 4])
    now[1] = torch.tensor([77, 0])
    want = posterior_reference(logits.cpu(), False, now.clone(), inv_temp.cpu())  # (the reference advances it)
    cases.append(dict(case="graph replay reads each row's state and inv_temp",
                      ok=float((out.cpu() == want).double().mean()) >= 0.95))
    posterior(logits, True, state, inv_temp, out)
    cases.append(dict(case="registered op greedy", ok=torch.equal(out, logits.argmax(-1))
                      and torch.equal(state.cpu(), now + torch.tensor([0, 1]))))
    bad = [c for c in cases if not c["ok"]]
    _write_summary("posterior", dict(op="posterior", sweep_seed=sweep_seed, cases=cases, failed=len(bad),
                                     passed=not bad, seconds=round(time.time() - t0, 1)))
    assert not bad, bad


@pytest.mark.gpu
def test_accept_and_commit_replay_in_a_cuda_graph():
    """Both ops captured once, replayed on fresh inputs copied into the captured buffers."""
    from plugins.kv_commit import kv_commit
    from plugins.tree_accept import tree_accept
    g = torch.Generator().manual_seed(7)
    b, depth, vocab, budget, y, d, f, l_max = 8, 7, 32, 63, 61, 576, 256, 512
    n, a = budget + 1, depth + 1
    dev = "cuda"
    post = torch.zeros(b, n, dtype=torch.long, device=dev)
    tok = torch.zeros(b, n, dtype=torch.long, device=dev)
    par = torch.zeros(b, n, dtype=torch.int32, device=dev)
    idx = torch.zeros(b, a, dtype=torch.int32, device=dev)
    alen = torch.zeros(b, dtype=torch.int32, device=dev)
    bonus = torch.zeros(b, dtype=torch.long, device=dev)
    cache = torch.randn(y, b, l_max, d, device=dev).bfloat16()
    lens = torch.zeros(b, dtype=torch.int32, device=dev)
    scratch = torch.randn(y, b, n, d, device=dev).bfloat16()
    feats = torch.randn(b, n, f, device=dev).bfloat16()
    ctx = torch.zeros(b, a, f, device=dev).bfloat16()

    def round_():
        tree_accept(post, tok, par, idx, alen, bonus)
        kv_commit(cache, lens, scratch, idx, alen, feats, ctx)

    round_()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        round_()
    for step in range(5):
        t, p = random_tree(g, b, depth, vocab, budget)
        q = random_posterior(g, t, p, vocab, "planted")
        tok.copy_(t)
        par.copy_(p)
        post.copy_(q)
        scratch.normal_()
        feats.normal_()
        ref = [x.clone().cpu() for x in (cache, lens, scratch, feats, ctx)]
        graph.replay()
        want_idx, want_len, want_bonus, _ = tree_accept_expected(q, t, p, a)
        assert torch.equal(alen.cpu(), want_len) and torch.equal(bonus.cpu(), want_bonus)
        for r in range(b):
            assert torch.equal(idx.cpu()[r, : want_len[r]], want_idx[r, : want_len[r]])
        kv_commit_reference(ref[0], ref[1], ref[2], idx.cpu(), want_len, ref[3], ref[4])
        assert torch.equal(cache.cpu(), ref[0]) and torch.equal(lens.cpu(), ref[1]) and torch.equal(ctx.cpu(), ref[4])


if __name__ == "__main__" and sys.argv[1:] == ["--interpreter"]:
    print(json.dumps(_interpreter_checks()))
