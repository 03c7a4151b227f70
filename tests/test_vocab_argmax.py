"""vocab_argmax (the TP greedy token, plugins/tree_accept/vocab_argmax.py): the two Triton kernels against the
torch reference on random rows: ties inside a slice and across ranks, the vocabulary's padding columns (valid <
V_l) holding the largest values, rows of -inf, NaN and +Inf logits (flagged; their token is unspecified).  CPU:
the interpreter in a subprocess; GPU (-m gpu): more cases.  And the whole path equals torch.argmax over the
gathered logits."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from gpu_cases import gpu_cases
from interpreter import interpreted

from plugins.tree_accept.vocab_argmax import local_reference, pick_reference


def random_case(g: torch.Generator, device: str) -> dict:
    """W ranks' slices of R = b * rpr rows: integer-valued logits so that ties are common."""
    w, b, rpr = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((1, 5), (1, 4), (1, 6)))
    v_l = int(torch.randint(3, 70, (1,), generator=g))
    valid = int(torch.randint(1, v_l + 1, (1,), generator=g))
    x = torch.randint(-4, 5, (w, b * rpr, v_l), generator=g).float()
    x[:, :, valid:] = 100.0  # padding columns: must never win
    kind = torch.rand(w, b * rpr, generator=g)
    x[kind < 0.05] = float("-inf")  # a whole slice of -inf
    r, c = torch.randint(0, b * rpr, (2,), generator=g), torch.randint(0, valid, (2,), generator=g)
    if kind.mean() < 0.5:
        x[0, r[0], c[0]] = float("nan")
    else:
        x[-1, r[1], c[1]] = float("inf")
    return dict(x=x.to(device), valid=valid, b=b)


def run_cases(device: str, count: int, seed: int = 0) -> list[dict]:
    import triton  # noqa: F401  (the kernels' launchers; TRITON_INTERPRET=1 on CPU)

    from plugins.tree_accept.vocab_argmax import _local_cuda, _pick_cuda
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(count):
        c = random_case(g, device)
        x, valid, b = c["x"], c["valid"], c["b"]
        w, rows = x.shape[:2]
        pairs = torch.empty(w, rows, 2, dtype=torch.float64, device=device)
        for j in range(w):
            _local_cuda(x[j], valid, j * 1000, pairs[j])
        want_pairs = torch.stack([local_reference(x[j], valid, j * 1000) for j in range(w)])
        ids = torch.empty(rows, dtype=torch.int64, device=device)
        flag = torch.empty(b, dtype=torch.int64, device=device)
        _pick_cuda(want_pairs.contiguous(), ids, flag)
        want_ids, want_flag = pick_reference(want_pairs, b)
        finite = torch.isfinite(want_pairs[..., 0]).all(0)  # [R] rows with a defined token
        nan = want_pairs[..., 0].isnan()
        same_pairs = torch.equal(pairs[~nan], want_pairs[~nan]) and torch.equal(pairs[..., 0].isnan(), nan)
        out.append(dict(case=k, pairs=bool(same_pairs), flag=bool(torch.equal(flag, want_flag)),
                        ids=bool(torch.equal(ids[finite], want_ids[finite]))))
    return out


@pytest.fixture(scope="module")
def interpreter_results():
    return interpreted(__file__)


def test_kernels_match_reference_in_interpreter(interpreter_results):
    assert len(interpreter_results) >= 30
    bad = [c for c in interpreter_results if not (c["pairs"] and c["flag"] and c["ids"])]
    assert not bad, bad


def test_reference_is_argmax_over_the_whole_vocabulary():
    """Slices of one row of logits, reduced per rank and picked: torch.argmax of the full row (ties to the
    lowest id), padding columns past each slice's valid width excluded; a NaN or Inf flags the request."""
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        full = torch.randint(-3, 4, (6, 40), generator=g).float()  # [R, V], R = b * rpr with b = 2
        slices = [full[:, j * 10:(j + 1) * 10] for j in range(4)]
        padded = [torch.cat([s, torch.full((6, 3), 99.0)], 1) for s in slices]  # 3 padding columns each
        every = torch.stack([local_reference(p, 10, j * 10) for j, p in enumerate(padded)])
        ids, flag = pick_reference(every, 2)
        assert torch.equal(ids, full.argmax(-1)) and not flag.any()
    full[4, 7] = float("nan")
    every = torch.stack([local_reference(full[:, j * 10:(j + 1) * 10], 10, j * 10) for j in range(4)])
    assert pick_reference(every, 2)[1].tolist() == [0, 1]


def test_bad_arguments_name_the_tensor():
    from plugins.tree_accept.vocab_argmax import vocab_argmax_local, vocab_argmax_pick
    with pytest.raises(ValueError, match="pair"):
        vocab_argmax_local(torch.zeros(3, 8), 8, 0, torch.zeros(3, 2))
    with pytest.raises(ValueError, match="valid"):
        vocab_argmax_local(torch.zeros(3, 8), 9, 0, torch.zeros(3, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="flag"):
        vocab_argmax_pick(torch.zeros(2, 6, 2, dtype=torch.float64), torch.zeros(6, dtype=torch.int64),
                          torch.zeros(4, dtype=torch.int64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernels_match_reference_on_gpu():
    cases = run_cases("cuda", gpu_cases(300), seed=5)
    bad = [c for c in cases if not (c["pairs"] and c["flag"] and c["ids"])]
    assert not bad, bad[:10]


if __name__ == "__main__" and "--interpreter" in sys.argv:
    print(json.dumps(run_cases("cpu", 40)))
