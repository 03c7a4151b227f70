"""round_emit: the Triton kernel against the torch reference (reference.py) on random rounds: stop tokens at
random slots (or none), max_new reached inside the round or not, frozen requests (count 0, live 0), AR rounds
(one candidate, count and bonus written too), tree rounds (the candidates gathered along the accepted path, the
drafter's context written, frozen requests' counts zeroed).
CPU: the interpreter in a subprocess; GPU (-m gpu): more cases.
Every output must equal the reference's bit for bit (integers)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from gpu_cases import gpu_cases
from interpreter import interpreted

from plugins.round_emit.reference import round_emit_reference


def random_round(g: torch.Generator, device: str, ar: bool, tree: bool = False) -> dict:
    """One random round's inputs (fresh tensors); tree: the candidates from tokens along the accepted path
    (count random for frozen requests too: the op zeroes it)."""
    def ints(lo, hi, *shape, dt=torch.int64):
        return torch.randint(lo, hi, shape, generator=g).to(device=device, dtype=dt)

    b = int(torch.randint(1, 6, (1,), generator=g))
    a = 1 if ar else int(torch.randint(1, 20, (1,), generator=g))
    s = int(torch.randint(1, 5, (1,), generator=g))
    vocab = 12  # small: stop tokens turn up among the candidates
    stop_ids = ints(0, vocab, b, s)
    stop_ids[ints(0, 2, b, s, dt=torch.bool)] = -1  # padding
    live = ints(0, 2, b, dt=torch.int32)
    live[0] = 1
    count = torch.where(live.bool(), ints(1, a + 1, b, dt=torch.int32), torch.zeros_like(live))
    produced = ints(0, 30, b, dt=torch.int32)
    max_new = produced + ints(1, a + 4, b, dt=torch.int32)
    args = dict(cand=ints(0, vocab, b, a), count=count, stop_ids=stop_ids, produced=produced, max_new=max_new,
                live=live, nonfinite=ints(0, 2, b), out=ints(-9, 9, b, a + 6),
                bonus=ints(0, vocab, b) if ar or tree else None)
    if ar and int(torch.randint(2, (1,), generator=g)):  # half the AR rounds also advance the committed lengths
        args["cache_lens"] = ints(0, 4000, b, dt=torch.int32)
    if tree:
        n = int(torch.randint(1, 40, (1,), generator=g))
        args.update(cand=None, count=ints(1, a + 1, b, dt=torch.int32), tokens=ints(0, vocab, b, n),
                    path_idx=ints(0, n, b, a, dt=torch.int32), ctx_tokens=ints(-9, 9, b, a))
    return args


def run_cases(device: str, count: int, seed: int = 0) -> list[dict]:
    from plugins.round_emit.kernel import round_emit_triton
    g = torch.Generator().manual_seed(seed)
    results = []
    for k in range(count):
        ar, tree = k % 3 == 0, k % 3 == 1
        args = random_round(g, device, ar, tree)
        mine = {n: (t.clone() if t is not None else None) for n, t in args.items()}
        want = {n: (t.clone() if t is not None else None) for n, t in args.items()}
        round_emit_triton(**mine)
        round_emit_reference(**want)
        bad = [n for n in args if mine[n] is not None and not torch.equal(mine[n], want[n])]
        b, a = args["out"].shape[0], args["out"].shape[1] - 6
        results.append(dict(case=f"b{b} a{a} ar={ar} tree={tree}", ok=not bad, bad=bad))
    return results


@pytest.fixture(scope="module")
def interpreter_results():
    return interpreted(__file__)


def test_kernel_matches_reference_in_interpreter(interpreter_results):
    assert len(interpreter_results) >= 30 and all(c["ok"] for c in interpreter_results), \
        [c for c in interpreter_results if not c["ok"]]


def test_reference_stops_at_the_first_stop_or_max_new():
    """Hand-made rows: the emission and the host row the round's reader relies on."""
    cand = torch.tensor([[5, 7, 9, 7], [1, 2, 3, 4], [6, 6, 6, 6]])
    count = torch.tensor([4, 3, 0], dtype=torch.int32)
    stop_ids = torch.tensor([[7, -1], [-1, -1], [6, -1]])
    produced = torch.tensor([0, 10, 0], dtype=torch.int32)
    max_new = torch.tensor([100, 12, 100], dtype=torch.int32)
    live = torch.tensor([1, 1, 0], dtype=torch.int32)
    nonfinite = torch.tensor([0, 1, 0])
    out = torch.full((3, 10), -5)
    round_emit_reference(cand, count, stop_ids, produced, max_new, live, nonfinite, out)
    assert produced.tolist() == [2, 12, 0]  # up to the stop token 7; 2 more reach max_new 12; frozen: none
    assert live.tolist() == [0, 0, 0]
    assert out[:, 4:8].tolist() == [[2, 0, 4, 0], [2, 0, 3, 1], [0, 0, 0, 0]] and out[:, 8:].eq(-5).all()
    bonus = torch.tensor([3, 3, 3])
    count, live, produced = torch.zeros(3, dtype=torch.int32), torch.tensor([1, 0, 1], dtype=torch.int32), \
        torch.zeros(3, dtype=torch.int32)
    round_emit_reference(cand[:, :1], count, stop_ids, produced, max_new, live, nonfinite, out, bonus)
    assert count.tolist() == [1, 0, 1] and bonus.tolist() == [5, 3, 6] and live.tolist() == [1, 0, 0]
    lens = torch.tensor([7, 7, 7], dtype=torch.int32)  # an AR step's kv_commit(advance=False): the emit advances
    round_emit_reference(cand[:, :1], count, stop_ids, produced, max_new, live, nonfinite, out, bonus,
                         cache_lens=lens)
    assert lens.tolist() == [8, 7, 7]  # by the step's count := live (request 2 stopped in the step before)


def test_reference_tree_round_takes_the_path_then_the_bonus():
    """A tree round by hand: path = tokens[path_idx], the candidates are the path past the root, then the bonus
    at the last accepted slot; a frozen request accepts nothing."""
    tokens = torch.tensor([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]])
    path_idx = torch.tensor([[0, 2, 4], [0, 1, 3]], dtype=torch.int32)
    count, live = torch.tensor([2, 3], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32)
    ctx, out = torch.zeros(2, 3, dtype=torch.int64), torch.full((2, 9), -5)
    produced, max_new = torch.zeros(2, dtype=torch.int32), torch.full((2,), 100, dtype=torch.int32)
    round_emit_reference(None, count, torch.full((2, 1), -1), produced, max_new, live,
                         torch.zeros(2, dtype=torch.int64),
                         out, torch.tensor([7, 8]), tokens, path_idx, ctx)
    assert ctx.tolist() == [[10, 12, 14], [20, 21, 23]] and count.tolist() == [2, 0]
    assert out[0, :3].tolist() == [12, 7, 10] and produced.tolist() == [2, 0]  # slot 1 is the last accepted: bonus


def test_bad_arguments_name_the_tensor():
    from plugins.round_emit import round_emit
    z32 = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="max_new"):
        round_emit(torch.zeros(2, 3, dtype=torch.int64), z32, torch.zeros(2, 1, dtype=torch.int64), z32.clone(),
                   torch.zeros(2), z32.clone(), torch.zeros(2, dtype=torch.int64), torch.zeros(2, 9, dtype=torch.int64))
    with pytest.raises(ValueError, match="cache_lens"):  # a tree round's kv_commit reads the unadvanced lengths
        round_emit(None, z32, torch.zeros(2, 1, dtype=torch.int64), z32.clone(), z32.clone(), z32.clone(),
                   torch.zeros(2, dtype=torch.int64), torch.zeros(2, 9, dtype=torch.int64),
                   torch.zeros(2, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.int64), z32.view(2, 1),
                   torch.zeros(2, 1, dtype=torch.int64), z32.clone())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_matches_reference_on_gpu():
    cases = run_cases("cuda", gpu_cases(300), seed=7)
    assert all(c["ok"] for c in cases), [c for c in cases if not c["ok"]][:10]


if __name__ == "__main__" and "--interpreter" in sys.argv:
    print(json.dumps(run_cases("cpu", 40)))
