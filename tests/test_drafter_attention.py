"""drafter_attention: the Triton kernels (split + combine) against the torch reference on fresh random blocks:
requests of different visible lengths (1 .. the capacity, or past it: clamped), 1-4 kv heads of 1-4 query heads
each, 2-8 slots, head dims 16-128, bf16 and fp32, one split (the direct path) or several.  CPU: the interpreter in
a subprocess; GPU (-m gpu): 200+ cases.  The kernel sums in another order than the reference (online softmax,
unnormalised probabilities rounded), so both are compared with the exact fp64 attention of the same stored
values: the kernel's error must stay within twice the reference's plus a few units of the dtype's rounding
(units(): more for fp32 on the GPU, whose exp is approximate)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from gpu_cases import gpu_cases
from interpreter import interpreted, interpreter_shims

from plugins.drafter_attention.reference import drafter_attention_reference


def exact(q, k_cache, v_cache, visible, scale) -> torch.Tensor:
    """The attention of the stored values in fp64, probabilities unrounded: [b, s, h*e]."""
    b, s, h, e = q.shape
    g = k_cache.shape[2]
    rep = h // g
    out = torch.empty(b, s, h, e, dtype=torch.float64)
    for r in range(b):
        n = min(int(visible[r]), k_cache.shape[1])  # never past the cache
        k, v = k_cache[r, :n].double().cpu(), v_cache[r, :n].double().cpu()  # [n, g, e]
        for hh in range(h):
            sc = q[r, :, hh].double().cpu() @ k[:, hh // rep].T * scale  # [s, n]
            out[r, :, hh] = sc.softmax(-1) @ v[:, hh // rep]
    return out.reshape(b, s, h * e)


def units(q: torch.Tensor) -> int:
    """The dtype's rounding units the kernel may add to twice the reference's error: 4, and 32 for fp32 on the GPU,
    whose exp2 is the hardware's approximation (ex2.approx, ~2 ulp) at every rescaling of the online softmax where
    the reference's exp is correctly rounded.  32 units of fp32 is 4e-6 of the largest output: a wrong row, mask or
    scale is off by orders of magnitude more."""
    return 32 if q.is_cuda and q.dtype == torch.float32 else 4


def random_case(g: torch.Generator, device: str, big: bool) -> dict:
    def pick(*xs):
        return xs[int(torch.randint(len(xs), (1,), generator=g))]

    b, s, kv, rep = pick(1, 2, 3), pick(2, 4, 5, 8), pick(1, 2, 4), pick(1, 2, 4)
    e = pick(16, 32, 64, 128) if big else pick(16, 32, 64)
    cap = int(torch.randint(s, 1500 if big else 400, (1,), generator=g))
    dtype = pick(torch.bfloat16, torch.float32)
    visible = torch.randint(1, cap + 1, (b,), generator=g)
    visible[0] = cap  # one request sees the whole cache
    if pick(False, False, True):
        visible[-1] = cap + 7  # past the cache: clamped to it
    scale = e ** -0.5 * pick(1.0, 3.0)  # sharper softmax too
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    return dict(q=rand(b, s, kv * rep, e), k_cache=rand(b, cap, kv, e), v_cache=rand(b, cap, kv, e),
                visible=visible.to(device=device, dtype=pick(torch.int32, torch.int64)), scale=scale,
                splits=pick(1, 2, 3, 7, None))


def run_cases(device: str, count: int, seed: int = 0, big: bool = False) -> list[dict]:
    from plugins.drafter_attention.kernel import drafter_attention_triton
    g = torch.Generator().manual_seed(seed)
    results = []
    for _ in range(count):
        c = random_case(g, device, big)
        q, k, v, vis, scale = c["q"], c["k_cache"], c["v_cache"], c["visible"], c["scale"]
        b, s, h, e = q.shape
        out = torch.full((b, s, h * e), float("nan"), dtype=q.dtype, device=device)
        drafter_attention_triton(q, k, v, vis, scale, out, splits=c["splits"])
        ref = drafter_attention_reference(q, k, v, vis, scale)
        want = exact(q, k, v, vis, scale)
        err_k = (out.double().cpu() - want).abs().max().item()
        err_r = (ref.double().cpu() - want).abs().max().item()
        unit = torch.finfo(q.dtype).eps * want.abs().max().item()
        ok = bool(torch.isfinite(out).all()) and err_k <= 2 * err_r + units(q) * unit
        results.append(dict(case=f"b{b} s{s} h{h} g{k.shape[2]} e{e} cap{k.shape[1]} {q.dtype} splits {c['splits']}",
                            ok=ok, err_kernel=err_k, err_reference=err_r))
    return results


@pytest.fixture(scope="module")
def interpreter_results():
    return interpreted(__file__)


def test_kernel_matches_reference_in_interpreter(interpreter_results):
    assert len(interpreter_results) >= 24 and all(c["ok"] for c in interpreter_results), \
        [c for c in interpreter_results if not c["ok"]]


def test_reference_is_the_attention_of_the_visible_rows():
    """Rows past visible change nothing; the reference is within bf16 rounding of the exact attention."""
    g = torch.Generator().manual_seed(3)
    c = random_case(g, "cpu", False)
    q, k, v, vis, scale = c["q"], c["k_cache"], c["v_cache"], c["visible"], c["scale"]
    ref = drafter_attention_reference(q, k, v, vis, scale)
    k2, v2 = k.clone(), v.clone()
    for r in range(k.shape[0]):
        k2[r, int(vis[r]):] = 1e4
        v2[r, int(vis[r]):] = -1e4
    assert torch.equal(drafter_attention_reference(q, k2, v2, vis, scale), ref)
    tol = 8 * torch.finfo(q.dtype).eps * 4
    torch.testing.assert_close(ref.double(), exact(q, k, v, vis, scale), atol=tol, rtol=tol)


def test_bad_arguments_name_the_tensor():
    from plugins.drafter_attention import drafter_attention
    q, kv = torch.zeros(1, 4, 6, 32), torch.zeros(1, 10, 4, 32)
    with pytest.raises(ValueError, match="k_cache"):
        drafter_attention(q, kv, kv, torch.ones(1, dtype=torch.int32), 1.0)  # 4 kv heads do not divide 6
    with pytest.raises(ValueError, match="visible"):
        drafter_attention(q[:, :, :4], kv, kv, torch.ones(2, dtype=torch.int32), 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_matches_reference_on_gpu():
    cases = run_cases("cuda", gpu_cases(240), seed=11, big=True)
    assert all(c["ok"] for c in cases), [c for c in cases if not c["ok"]][:10]


if __name__ == "__main__" and "--interpreter" in sys.argv:
    interpreter_shims()
    print(json.dumps(run_cases("cpu", 24)))
