"""kdtree::budget_select / budget_observe (plugins/budget_choice): the Triton programs against the torch reference
on random round states (CPU: the kernels under TRITON_INTERPRET=1 in a subprocess; the interpreter is chosen at
import).  Cases: batch 1-8 with frozen rows and all-frozen rounds, 3-9 buckets up to 256, full and capped
rounds, forced picks, calibration with no, some and all buckets measured.  The op itself (the reference on CPU)
runs in every budget-auto test of tests/test_budget_auto.py."""

from __future__ import annotations

import json
import random
import sys

import pytest
import torch
from interpreter import interpreted


def _state(rng: random.Random, g: torch.Generator) -> dict:
    b = rng.choice([1, 2, 3, 8])
    buckets = [1, 2, 4, 8, 16, 32, 64, 128, 256][:rng.randint(3, 9)]
    nb, n = len(buckets), buckets[-1] + 1
    scores = -torch.rand(b, n, generator=g).cumsum(1)  # path log-probs, non-increasing
    scores[:, 0] = 0
    live = (torch.rand(b, generator=g) < (0.0 if rng.random() < 0.15 else 0.7)).to(torch.int32)
    covered = torch.rand(nb, generator=g) < rng.choice([0.0, 0.5, 1.0])
    return {"scores": scores, "live": live, "sizes": torch.tensor(buckets),
            "seen": torch.rand(2, nb, generator=g) + 0.2,
            "covered": covered, "force": torch.tensor([rng.choice([-1, -1, -1, rng.randrange(nb)])]),
            "cap_cost": torch.rand(nb, nb, generator=g) * 500 + 50, "value": torch.rand(2, nb, generator=g),
            "cap": rng.choice([nb - 1, rng.randrange(nb)]), "min_cap": rng.randrange(nb),
            "accept_len": torch.randint(0, 6, (b,), generator=g, dtype=torch.int32) * live,
            "accept_idx": torch.randint(0, n, (b, 6), generator=g, dtype=torch.int32),
            "verified": buckets[rng.randrange(nb)]}


def _run(s: dict, triton_path: bool) -> dict:
    from plugins.budget_choice.kernel import observe_triton, select_triton
    from plugins.budget_choice.reference import (
        DECAY,
        S_MAX,
        S_MIN,
        observe_reference,
        select_reference,
    )
    nb = s["sizes"].shape[0]
    dev = s["scores"].device  # the outputs live where the inputs do (CUDA for the GPU test)
    value, hint = s["value"].clone(), torch.full((), -7, dtype=torch.int64, device=dev)
    extra, pick = torch.zeros(nb, device=dev), torch.zeros((), dtype=torch.int64, device=dev)
    hot = torch.zeros(nb, dtype=torch.bool, device=dev)
    seen, covered = s["seen"].clone(), s["covered"].clone()
    args = (s["scores"], s["live"], s["sizes"], seen, covered, s["force"], s["cap_cost"], value, hint, extra, pick,
            hot, s["cap"], s["min_cap"])
    if triton_path:
        select_triton(*args, DECAY, S_MIN, S_MAX)
        observe_triton(s["accept_len"], s["accept_idx"], s["sizes"], s["verified"], extra, seen, covered, DECAY)
    else:
        select_reference(*args)
        observe_reference(s["accept_len"], s["accept_idx"], s["sizes"], s["verified"], extra, seen, covered)
    return {"value": value.tolist(), "hint": int(hint), "extra": extra.tolist(), "pick": int(pick),
            "hot": hot.tolist(), "seen": seen.tolist(), "covered": covered.tolist()}


def interpreter_worker(n: int, device: str = "cpu") -> list[dict]:
    """n random states through the reference (CPU) and the Triton programs (on `device`)."""
    rng, g = random.Random(7), torch.Generator().manual_seed(7)
    out = []
    for _ in range(n):
        s = _state(rng, g)
        on_dev = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        out.append({"ref": _run(s, False), "triton": _run(on_dev, True), "full": s["cap"] == s["sizes"].shape[0] - 1})
    return out


def _check(cases: list[dict]) -> None:
    assert any(c["full"] for c in cases) and not all(c["full"] for c in cases)
    for i, c in enumerate(cases):
        ref, tri = c["ref"], c["triton"]
        for key in ("hint", "pick", "hot", "covered"):
            assert ref[key] == tri[key], (i, key, ref[key], tri[key])
        for key in ("value", "extra", "seen"):
            torch.testing.assert_close(torch.tensor(tri[key]), torch.tensor(ref[key]), rtol=1e-5, atol=1e-6,
                                       msg=lambda m, i=i, key=key: f"case {i} {key}: {m}")


@pytest.mark.gpu
def test_gpu_programs_match_the_reference():
    _check(interpreter_worker(40, "cuda"))


def test_triton_programs_match_the_reference():
    cases = interpreted(__file__, "40")
    assert len(cases) == 40
    _check(cases)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--interpreter"]:
        print(json.dumps(interpreter_worker(int(sys.argv[2]))))
